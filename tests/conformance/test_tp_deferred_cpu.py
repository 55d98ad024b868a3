"""Deferred capture under tensor and pipeline parallelism, on CPU: an engine core and two workers
(TP ranks, or pipeline stages) as three processes over gloo (tp_deferred_worker.py). Every capture is a collective over the workers'
group, as a TP capture is; the ranks must capture the same graph at the same moment and
dispatch alike after every step and every idle capture. A control run with each rank's
step-pause rule left on shows that the check sees ranks diverge."""

import json
from pathlib import Path

import pytest

from capplan.releases import RELEASES
from tests.conformance import oracle_python
from tests.conformance.releases import ends
from tests.conformance.test_dp_plan_check import _free_port
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "tp_deferred_worker.py"
WORLD = 3  # the engine core and two TP workers


def _ranks(version: str, worker: Path, args: list[list[str]], outs: list[Path]) -> list[dict]:
    """`worker` in one process per rank, each given its `args` (rank first) and its output path,
    in the oracle's Python for `version`; each rank's report."""
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    jobs = [oracle_python.start([worker, *rank_args, out], version=version) for rank_args, out in zip(args, outs)]
    try:
        for job in jobs:
            job.wait(timeout=300)
            assert job.returncode == 0, job.stderr[-3000:]
    finally:
        for job in jobs:
            job.kill()
    return [json.loads(out.read_text()) for out in outs]


def _run(version: str, mode: str, tmp: Path) -> list[dict]:
    port = str(_free_port())
    args = [[str(rank), str(WORLD), port, mode] for rank in range(WORLD)]
    return _ranks(version, WORKER, args, [tmp / f"{mode}-{rank}.json" for rank in range(WORLD)])


@pytest.mark.conformance
@pytest.mark.parametrize("layout", ["lockstep", "pipeline"])
@pytest.mark.parametrize("version", ends())
def test_tp_and_pp_ranks_capture_and_dispatch_in_lockstep(version, layout, tmp_path):
    core, *workers = _run(version, layout, tmp_path)
    assert core["error"] is None and all(w["error"] is None for w in workers), [
        core["error"],
        *(w["error"] for w in workers),
    ]
    for w in workers:
        assert w["step_captures"] is False  # more than one TP rank: idle turns only
        assert w["mismatch_count"] == 0, w["mismatches"]
        assert w["final_set_is_the_plan"] and w["deferred_in_plan_order"]
        assert w["states"] == core["steps"] + core["idle_rpcs"]  # every broadcast step and call seen
        # the fallbacks changed as graphs landed (distinct dispatch tables: some deferred graphs
        # are captured at start, the start-up sample or, after a profiling pass, the first ones)
        assert w["dispatch_states"] > 5
    assert workers[0]["captured_order"] == workers[1]["captured_order"]
    if layout == "pipeline":  # only the first stage reads an attention builder: the stages join what they read
        assert workers[0]["attention_thresholds"] == workers[1]["attention_thresholds"] == [8]
        assert workers[0]["warmed"] and workers[0]["warmed"] == workers[1]["warmed"]
    if RELEASES[version].profiling_capture:
        # vLLM's profiling pass samples alike on every rank; after it, the start-up capture takes
        # the first deferred graphs until any rank reads memory: rank 1 reads a granule for the
        # 2nd, rank 2 for the 4th, so both stop after the 2nd
        assert workers[0]["profiled"] and workers[0]["profiled"] == workers[1]["profiled"]
        assert not workers[0]["sampled_at_start"] and workers[0]["free_at_start"] == workers[1]["free_at_start"]
        assert len(workers[0]["free_at_start"]) == 2
        assert workers[0]["free_at_start_bytes"] == [0, 2 * 2**20] and workers[1]["free_at_start_bytes"] == [0, 0]
    else:  # no profiling pass: the start-up capture samples, alike on every rank
        assert workers[0]["sampled_at_start"] and workers[0]["sampled_at_start"] == workers[1]["sampled_at_start"]
    assert core["pending_seen"][-1] == 0 and core["idle_rpcs"] > 1
    assert core["steps"] > 10  # steps between idle turns: intermediate states under traffic


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends()[:1])
def test_the_lockstep_check_sees_rank_local_step_captures_diverge(version, tmp_path):
    core, *workers = _run(version, "rank_local", tmp_path)
    assert all(w["step_captures"] is True for w in workers)
    # one rank captures before a step while the other dispatches: the collectives pair wrongly
    assert any(w["mismatch_count"] for w in workers), [(w["mismatch_count"], w["error"]) for w in workers]


@pytest.mark.conformance
@pytest.mark.parametrize("version", [v for v in ends()[-1:] if RELEASES[v].profiling_capture])
def test_the_lockstep_check_sees_rank_local_start_up_captures_diverge(version, tmp_path):
    """The control of the start-up capture after vLLM's profiling pass: each rank deciding on its
    own readings which deferred graphs it captures before the engine is ready (rank 1 stops after
    the 2nd, rank 2 after the 4th) pairs the ranks' collectives wrongly."""
    core, *workers = _run(version, "rank_local_free", tmp_path)
    assert any(w["mismatch_count"] for w in workers), [(w["mismatch_count"], w["error"]) for w in workers]


VOTE_WORKER = Path(__file__).parent / "ranks_vote_worker.py"


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends()[-1:])
def test_vllms_tp_and_pp_groups_carry_the_ranks_vote(version, tmp_path):
    """vLLM's own TP and PP groups (TP 2 x PP 2, gloo on CPU, built as a worker builds them) carry
    the vote by which ranks decide what they capture before the engine is ready: one rank's no is
    every rank's no, and at start every rank takes the deferred graphs up to the first that any
    rank reads memory for (rank 0's 3rd; the others would go on to their 5th, 7th and 9th)."""
    port, world = str(_free_port()), 4
    args = [[str(rank), str(world), "2", port] for rank in range(world)]
    ranks = _ranks(version, VOTE_WORKER, args, [tmp_path / f"vote-{rank}.json" for rank in range(world)])
    for r in ranks:
        assert r["vllm"] == version and r["group_sizes"] == [2, 2]
        assert r["no_from_each"] == [False] * world and r["every_yes"] is True
    assert all(r["free_at_start"] == ranks[0]["free_at_start"] for r in ranks)
    assert len(ranks[0]["free_at_start"]) == 3


PLAN_WORKER = Path(__file__).parent / "ranks_plan_worker.py"


def _plan_check(version: str, mode: str, tmp: Path) -> list[dict]:
    port, world = str(_free_port()), 4
    args = [[str(rank), str(world), "2", port, mode] for rank in range(world)]
    return _ranks(version, PLAN_WORKER, args, [tmp / f"plan-{mode}-{rank}.json" for rank in range(world)])


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends())
def test_every_tp_and_pp_rank_starts_with_the_plan_or_none_does(version, tmp_path):
    """vLLM's world group (TP 2 x PP 2, gloo on CPU, as two nodes of two GPUs) carries the plan
    check, each rank building vLLM's real manager. One plan on every rank: all start with it. The
    last rank refusing its own plan, or started without CAPPLAN_PLAN (a node launched without it):
    every rank refuses, naming that rank, where before the others captured the plan's graphs and
    that rank vLLM's (or the others waited in a collective)."""
    plan = _plan_check(version, "plan", tmp_path)
    assert [r["same"]["refused"] for r in plan] == [None] * 4 and all(r["same"]["plan_in_force"] for r in plan)
    assert len({r["same"]["graphs"] for r in plan}) == 1 and plan[0]["elastic_ep_alone_returned"]
    assert "lora.max_loras: plan 4, engine 8" in plan[3]["refuses"]["refused"]
    for rank, r in enumerate(plan[:3]):
        assert r["refuses"]["refused"].startswith(f"capplan (rank {rank}): rank 3 refused the plan, so this rank stops")
    for rank, r in enumerate(_plan_check(version, "noplan", tmp_path)):
        assert r["vllm"] == version and r["world"] == 4
        assert r["same"]["refused"].startswith(f"capplan (rank {rank}): the engine's ranks loaded different plans")
        assert "rank 3: no plan" in r["same"]["refused"] and "rank 2: sha256:" in r["same"]["refused"]
