"""Two real processes, torch.distributed with gloo on CPU: ranks with the same
plan start, ranks with different plans both refuse before capture."""

import os
import socket
import subprocess
from pathlib import Path

import pytest

from capplan.loading import spec_from_data
from capplan.planfile import render_plan
from capplan.planner import compile_plan
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "parallel": {"data_parallel_size": 2},
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
    python = ORACLE_DIR / "venv" / "bin" / "python"  # has torch (CPU); the project venv does not
    if not python.exists():
        _missing(f"{python} is missing")
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT / "src", ROOT)))}
    procs = [
        subprocess.Popen(
            [str(python), str(Path(__file__).parent / "dp_check_worker.py"), str(rank), port, str(plan)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, plan in enumerate(plans)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        outs.append(out.strip().splitlines()[-1])
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
        assert line.startswith(f"refused: capplan (DP rank {rank}): data-parallel ranks loaded different plans")
        assert "Nothing was captured" in line
