"""Ray workers and the plan: a Ray actor does not inherit the launching process's environment, it
gets what vLLM copies to it. The front-end check asks vLLM's own rule (`get_env_vars_to_copy`)
whether CAPPLAN_PLAN is copied, and refuses the start where it is not; `capplan apply` adds
capplan's prefix to vLLM's list, so under it the plan reaches every worker. Run with each
release's vLLM (the oracle's Python); vLLM's `ParallelConfig.use_ray` is read on a stand-in
config (a real one with the Ray backend needs Ray installed)."""

import json
import os
import subprocess

import pytest

from capplan.envvars import PLAN, RAY_PREFIXES, with_ray_prefix
from tests.conformance.releases import ends
from tests.conformance.test_tp_deferred_cpu import ROOT
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

SCRIPT = """
import json, os, sys
from types import SimpleNamespace
import vllm
from vllm.config import ParallelConfig
from capplan.runtime.hooks.config import ray_problem

use_ray = ParallelConfig.use_ray.fget
os.environ["CAPPLAN_PLAN"] = "/plans/p.plan.yaml"
answers = {}
for name, prefixes in json.loads(sys.argv[1]).items():  # each case: vLLM's list of prefixes, or none
    os.environ.pop("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", None)
    if prefixes is not None:
        os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] = prefixes
    answers[name] = ray_problem("/plans/p.plan.yaml", SimpleNamespace(use_ray=True))
print(json.dumps({
    "vllm": vllm.__version__,
    "use_ray": [use_ray(SimpleNamespace(distributed_executor_backend=b)) for b in ("ray", "mp", "uni", None)],
    "not_ray": ray_problem("/plans/p.plan.yaml", SimpleNamespace(use_ray=False)),
    "ray": answers,
}))
"""
CASES = {
    "plain": None,
    "users_own": "LMCACHE_EXTRA_,MY_",  # a list of the user's own that leaves capplan out
    "applied": with_ray_prefix(None),
    "applied_to_users": with_ray_prefix("MY_"),
    "applied_again": with_ray_prefix("MY_, CAPPLAN_"),
}


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends())
def test_ray_workers_without_the_plan_are_refused_and_apply_s_environment_reaches_them(version):
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    env = {k: v for k, v in os.environ.items() if k not in (PLAN, RAY_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (ORACLE_DIR / "src" / version, ROOT / "src")))
    python = str(ORACLE_DIR / "venv" / "bin" / "python")
    run = subprocess.run(
        [python, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["vllm"] == version and found["use_ray"] == [True, False, False, False]
    assert found["not_ray"] is None
    refused = found["ray"]
    for case in ("plain", "users_own"):
        assert refused[case].startswith("capplan: this engine's workers are Ray actors"), case
        assert f"set {RAY_PREFIXES}=CAPPLAN_" in refused[case] and "/plans/p.plan.yaml" in refused[case]
    assert [refused[c] for c in ("applied", "applied_to_users", "applied_again")] == [None] * 3
