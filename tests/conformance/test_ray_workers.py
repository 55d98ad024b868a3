"""Ray actors and the plan: a Ray actor does not inherit the launching process's environment, it
gets what vLLM passes to it, by a rule that depends on the kind of actor and on the release. The
front-end check asks vLLM's own rule (`get_env_vars_to_copy`, `RAY_NON_CARRY_OVER_ENV_VARS`,
`VLLM_USE_RAY_V2_EXECUTOR_BACKEND`) whether CAPPLAN_PLAN reaches them, and refuses the start
where it does not; `capplan apply` adds capplan's prefix to vLLM's list. Run with each release's
vLLM (the oracle's Python); the engine's parallel config is a stand-in (a real one with a Ray
backend needs Ray installed), and vLLM's `ParallelConfig.use_ray` is read off it."""

import json
import os

import pytest

from capplan.envvars import PLAN, RAY_PREFIXES, with_ray_prefix
from tests.conformance import oracle_python
from tests.conformance.releases import ends
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

SCRIPT = """
import json, os, sys
from types import SimpleNamespace
import vllm
from vllm.config import ParallelConfig
import vllm.ray.ray_env as ray_env
from capplan.runtime.hooks.config import ray_problem

use_ray = ParallelConfig.use_ray.fget
os.environ["CAPPLAN_PLAN"] = "/plans/p.plan.yaml"
PREFIXES, V2 = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"


def ask(executor, dp_backend, prefixes=None, v2=None):
    for name, value in ((PREFIXES, prefixes), (V2, v2)):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    config = SimpleNamespace(distributed_executor_backend=executor, data_parallel_backend=dp_backend)
    config.use_ray = use_ray(config)
    return ray_problem("/plans/p.plan.yaml", config)


cases = json.loads(sys.argv[1])
answers = {name: ask(**case) for name, case in cases.items()}
ray_env.RAY_NON_CARRY_OVER_ENV_VARS.add("CAPPLAN_PLAN")  # as the user's file would list it
answers["excluded_by_file"] = ask("ray", "mp")
print(json.dumps({"vllm": vllm.__version__, "answers": answers}))
"""
APPLIED = with_ray_prefix(None)
CASES = {
    "mp": {"executor": "mp", "dp_backend": "mp"},
    "workers": {"executor": "ray", "dp_backend": "mp"},  # vLLM's default Ray executor: the whole environment
    "workers_first_executor": {"executor": "ray", "dp_backend": "mp", "v2": "0"},
    "workers_first_executor_applied": {"executor": "ray", "dp_backend": "mp", "v2": "0", "prefixes": APPLIED},
    "cores": {"executor": "mp", "dp_backend": "ray"},
    "cores_users_own": {"executor": "mp", "dp_backend": "ray", "prefixes": "LMCACHE_EXTRA_,MY_"},
    "cores_applied": {"executor": "ray", "dp_backend": "ray", "prefixes": APPLIED},
    "cores_applied_to_users": {"executor": "mp", "dp_backend": "ray", "prefixes": with_ray_prefix("MY_")},
}


@pytest.mark.conformance
@pytest.mark.parametrize("version", ends())
def test_ray_actors_the_plan_would_not_reach_are_refused_and_apply_s_environment_reaches_them(version):
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    env = {k: v for k, v in os.environ.items() if k not in (PLAN, RAY_PREFIXES, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND")}
    run = oracle_python.run(["-c", SCRIPT, json.dumps(CASES)], version=version, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["vllm"] == version
    answers = found["answers"]
    reached = ["mp", "workers", "workers_first_executor_applied", "cores_applied", "cores_applied_to_users"]
    assert {name: answers[name] for name in reached} == dict.fromkeys(reached)
    for case in ("cores", "cores_users_own"):
        assert answers[case].startswith("capplan: this engine's engine cores are Ray actors"), case
        assert f"set {RAY_PREFIXES}=CAPPLAN_" in answers[case] and "/plans/p.plan.yaml" in answers[case]
    first = answers["workers_first_executor"]  # vLLM's first Ray executor: gone in 0.33.0
    if tuple(int(x) for x in version.split(".")[:2]) < (0, 33):
        assert first.startswith("capplan: this engine's workers are Ray actors, which get only")
    else:
        assert first is None
    assert answers["excluded_by_file"].startswith("capplan: vLLM's RAY_NON_CARRY_OVER_ENV_VARS file keeps")
