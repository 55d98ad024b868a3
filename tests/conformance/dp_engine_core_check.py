"""A dense and an MoE DP 2 launch through vLLM's real engine-core start-up, on CPU.

Run in the oracle venv: PYTHONPATH=SRC/<version>:REPO/src:REPO python dp_engine_core_check.py OUT.json
`EngineCoreProc.run_engine_core` runs as vLLM runs it in each engine process, for DP rank 1
of 2; only the two engine classes it builds are replaced, by stand-ins that record the
parallel config they are given (that is the config the engine then runs with) and stop.
Then capplan's plan for each spec is set beside what the engine holds: the DP size its plan
assumes, the engine check on those fields, and the rank its report and trace are named by.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import vllm  # noqa: F401
import vllm.v1.engine.core as core
from vllm.config import ParallelConfig

from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.runtime.dp_check import launch_rank
from capplan.runtime.versions import detect_release
from capplan.settings import BY_NAME, engine_values

LORA = {"enabled": True, "max_loras": 4, "specialize_active": True}


class Stop(BaseException):
    """Raised by the stand-ins once the engine's config is recorded (not an Exception: vLLM's
    handler logs and re-raises those)."""


def main(out: Path) -> None:
    run_engine_core = core.EngineCoreProc.run_engine_core
    built: dict[str, object] = {}

    def stand_in(name: str) -> type:
        class Engine:
            def __init__(self, *args, **kwargs) -> None:
                built["engine"] = name
                built["parallel_config"] = kwargs["vllm_config"].parallel_config
                raise Stop

        return Engine

    core.EngineCoreProc = stand_in("EngineCoreProc")
    core.DPEngineCoreProc = stand_in("DPEngineCoreProc")
    release = detect_release(vllm.__version__).version
    results = {}
    for moe in (False, True):
        parallel = ParallelConfig(data_parallel_size=2)
        cfg = SimpleNamespace(
            parallel_config=parallel, kv_transfer_config=None, model_config=SimpleNamespace(is_moe=moe)
        )
        try:
            run_engine_core(vllm_config=cfg, dp_rank=1, local_dp_rank=1)
        except Stop:
            pass
        pc = built["parallel_config"]
        plan = compile_plan(
            spec_from_data(
                {"target": {"vllm": release}, "lora": LORA, "parallel": {"data_parallel_size": 2, "moe": moe}},
                "dp",
            )
        )  # fmt: skip
        ours = engine_values(plan)
        results["moe" if moe else "dense"] = {
            "engine": built["engine"],
            "engine_dp_size": pc.data_parallel_size,
            "plan_dp_size": plan.dp.data_parallel_size,
            "graphs": len(plan.graphs),
            "check_dp": BY_NAME["parallel.data_parallel_size"].same(plan, pc.data_parallel_size),
            "check_moe": ours["parallel.moe"] == moe,
            "launch_rank": launch_rank(pc),
        }  # fmt: skip
    dp1 = compile_plan(spec_from_data({"target": {"vllm": release}, "lora": LORA}, "dp1"))
    results["dp1_graphs"] = len(dp1.graphs)
    results["vllm"] = release
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
