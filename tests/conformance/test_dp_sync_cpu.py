"""The runtime inside vLLM's real DP synchronisation: two processes, gloo, CPU.

Each rank installs the plan into vLLM's ModelCudaGraphManager and runs 3000
steps of vLLM's own `dispatch_cg_and_sync_dp` with its own batches and LoRA
mixes (vLLM 0.25.0 and 0.33.0 code). The ranks must agree on the padded
token count at every step, the report must count each step once, and a rank
that refuses its plan (or has none) must stop the other rank too.
"""

import json
from pathlib import Path

import pytest

from tests.conformance import oracle_python
from tests.conformance.releases import releases
from tests.conformance.test_dp_plan_check import _free_port
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "dp_sync_worker.py"


def _pair(version: str, mode: str, tmp: Path, worker: Path = WORKER) -> list[dict]:
    """The two ranks of `worker` (a DP check over gloo) in MODE: their result files."""
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    port = str(_free_port())
    outs = [tmp / f"{mode}-{rank}.json" for rank in (0, 1)]
    jobs = [oracle_python.start([worker, rank, port, mode, outs[rank]], version=version) for rank in (0, 1)]
    try:
        for job in jobs:
            job.wait(timeout=300)  # a hang (one rank waiting forever) fails here
            assert job.returncode == 0, job.stderr[-3000:]
    finally:
        for job in jobs:
            job.kill()
    return [json.loads(p.read_text()) for p in outs]


_SYNC_RUNS: dict[str, list[dict]] = {}


def _sync_pair(version: str) -> list[dict]:
    """The two ranks' "sync" run of a release, run once for the tests that read it."""
    if version not in _SYNC_RUNS:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="capplan-dp-sync-") as tmp:
            _SYNC_RUNS[version] = _pair(version, "sync", Path(tmp))
    return _SYNC_RUNS[version]


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_ranks_agree_on_every_padded_step(version):
    r0, r1 = _sync_pair(version)
    assert r0["refused"] is None and r1["refused"] is None
    assert len(r0["steps"]) == len(r1["steps"]) == 3000
    # The agreed token count is the same on both ranks at every step, while
    # the ranks' LoRA cases differ on many of them.
    # (Steps the ranks run eager together keep each rank's own count: vLLM
    # pads nothing then.) Eager is decided together: never one rank eager
    # and the other replaying.
    pairs = list(zip(r0["steps"], r1["steps"]))
    assert all((a[0] == "NONE") == (b[0] == "NONE") for a, b in pairs)
    graph_steps = [(a, b) for a, b in pairs if a[0] != "NONE"]
    assert len(graph_steps) > 2000
    assert all(a[1] == b[1] for a, b in graph_steps)
    assert sum(a[2] != b[2] for a, b in graph_steps) > 1000
    for r in (r0, r1):
        dp, dispatch = r["report"]["dp"], r["report"]["dispatch"]
        assert dp["rank"] == r["rank"] and dp["size"] == 2
        assert dp["audited_steps"] == len(graph_steps) and dp["token_disagreements"] == 0
        assert dp["steps"] == 3000 and dp["idle_steps"] == 0
        assert dp["padded_to_other_rank"] > 300 and dp["extra_tokens_from_other_ranks"] > 0
        assert dp["eager_together"] > 50 and dp["forced_eager"] > 0
        assert dp["at_own_size"] + dp["padded_to_other_rank"] + dp["eager_together"] == 3000
        # Each step counted once (the local pre-sync dispatch is not what runs).
        assert dispatch["calls"] == 3000
        assert dispatch["eager"] == sum(s[0] == "NONE" for s in r["steps"]) == dp["eager_together"]


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_one_rank_refusing_stops_both(version, tmp_path):
    r0, r1 = _pair(version, "mismatch", tmp_path)
    assert "does not match this engine" in r1["refused"] and "lora.max_loras: plan 4, engine 8" in r1["refused"]
    assert r0["refused"].startswith("capplan (rank 0): rank 1 refused the plan, so this rank stops too")
    assert "lora.max_loras: plan 4, engine 8" in r0["refused"]


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_rank_without_plan_stops_both(version, tmp_path):
    r0, r1 = _pair(version, "noplan", tmp_path)
    for rank, r in enumerate((r0, r1)):
        assert r["refused"].startswith(f"capplan (rank {rank}): the engine's ranks loaded different plans")
        assert "rank 1: no plan" in r["refused"]


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_simulate_of_the_rank_traces_reproduces_each_rank_s_report(version, tmp_path):
    """The ranks' traces (real steps only, as the recorder writes them, with the runtime's
    dp_step), replayed by `capplan simulate` through its model of DP sync, give every rank's
    graph and eager counts, graph by graph, as the runtime counted them inside vLLM's real
    DP sync: idle ranks' dummy steps and padding to the other rank's size included."""
    from capplan.batches import read_rank_traces
    from capplan.loading import spec_from_data
    from capplan.planner import compile_plan
    from capplan.traffic.simulate import simulate_ranks

    ranks = _sync_pair(version)
    paths = []
    for r in ranks:
        path = tmp_path / f"trace.rank{r['rank']}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in r["trace"]))
        paths.append(path)
    spec = spec_from_data(ranks[0]["spec"], "dp")
    plan = compile_plan(spec)
    sim = simulate_ranks(plan, [f.batches for f in read_rank_traces(paths, spec)])
    assert sim.dp_steps == 3000  # steps no trace has (both ranks idle) are filled in from dp_step
    for rank, got in zip(ranks, sim.ranks):
        dispatch = rank["report"]["dispatch"]
        assert dispatch["graph_hits"] > 1000 and dispatch["eager"] > 100  # both kinds really happen
        assert got.idle_steps > 300  # and so do idle ranks, padded to the other rank's batch
        assert {str(k): v for k, v in sorted(got.hits.items())} == dispatch["hits_by_graph"]
        assert (got.graph_steps, got.eager_steps) == (dispatch["graph_hits"], dispatch["eager"])
