"""Two real processes, torch.distributed with gloo on CPU: ranks with the same
plan start, ranks with different plans both refuse before capture."""

import socket
from pathlib import Path

import pytest

from capplan.loading import spec_from_data
from capplan.planfile import render_plan
from capplan.planner import compile_plan
from tests.conformance import oracle_python
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "parallel": {"data_parallel_size": 2, "moe": True},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(tmp: Path, name: str, spec: dict) -> Path:
    path = tmp / f"{name}.plan.yaml"
    path.write_text(render_plan(compile_plan(spec_from_data(spec, name)), f"capplan compile {name}.yaml"))
    return path


def _run_pair(plans: list[Path]) -> list[str]:
    python = oracle_python.PYTHON  # has torch (CPU); the project venv does not
    if not python.exists():
        _missing(f"{python} is missing")
    port = str(_free_port())
    worker = Path(__file__).parent / "dp_check_worker.py"
    jobs = [oracle_python.start([worker, rank, port, plan], version=None) for rank, plan in enumerate(plans)]
    outs = []
    for job in jobs:
        job.wait(timeout=120)
        assert job.returncode == 0, job.stderr[-2000:]
        outs.append(job.stdout.strip().splitlines()[-1])
    return outs


@pytest.mark.conformance
def test_same_plan_on_both_ranks_starts(tmp_path):
    plan = _write(tmp_path, "same", SPEC)
    assert _run_pair([plan, plan]) == ["ok", "ok"]


@pytest.mark.conformance
def test_different_plans_refuse_on_every_rank(tmp_path):
    a = _write(tmp_path, "a", SPEC)
    b = _write(tmp_path, "b", {**SPEC, "lora": {**SPEC["lora"], "max_loras": 8}})
    outs = _run_pair([a, b])
    for rank, line in enumerate(outs):
        assert line.startswith(f"refused: capplan (rank {rank}): the engine's ranks loaded different plans")
        assert "Nothing was captured" in line


@pytest.mark.conformance
@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_dense_and_moe_dp_launches_through_vllm_s_engine_core_start_up(version, tmp_path):
    """vLLM runs a dense model's DP ranks as independent engines with data_parallel_size 1 and
    an MoE model's in lockstep: the plan each spec gets is what its engine runs (a dense DP 2
    plan is the DP 1 plan), the engine check accepts the engine vLLM builds, and the report and
    trace are named by the engine's rank in the launch."""
    import json

    from tests.conformance.test_vllm_conformance import _oracle_ready, run_check

    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    out = tmp_path / "dp.json"
    run_check("dp_engine_core_check.py", version, out)
    found = json.loads(out.read_text())
    assert found["vllm"] == version
    dense, moe = found["dense"], found["moe"]
    assert dense["engine"] == "EngineCoreProc" and dense["engine_dp_size"] == 1
    assert dense["plan_dp_size"] == 1 and dense["graphs"] == found["dp1_graphs"]
    assert moe["engine"] == "DPEngineCoreProc" and moe["engine_dp_size"] == 2 and moe["plan_dp_size"] == 2
    assert moe["graphs"] > found["dp1_graphs"]  # the idle rank's LoRA case at every size
    for side in (dense, moe):
        assert side["check_dp"] and side["check_moe"] and side["launch_rank"] == 1
