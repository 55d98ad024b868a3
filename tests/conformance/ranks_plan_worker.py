"""One rank of the plan check over vLLM's real world group (gloo, on CPU): TP 2 x PP 2, as on two
nodes of two GPUs each, every rank building vLLM's real `ModelCudaGraphManager`.

    PYTHONPATH=SRC/<version>:REPO/src:REPO python ranks_plan_worker.py RANK WORLD TP PORT MODE OUT.json

Each rank builds vLLM's world, TP and PP groups as a worker does (`init_distributed_environment`,
`initialize_model_parallel`), then installs what the plugin installs in it and builds its manager:

- plan:    every rank with the plan. First every engine as the plan's: every rank starts. Then
           the last rank's engine with max_loras 8 against the plan's 4: it refuses its plan, and
           every other rank must stop too instead of waiting in the next collective.
- noplan:  the last rank without CAPPLAN_PLAN (a node started without it): the plugin installs the
           plan check alone there. Every rank must refuse, naming that rank, instead of the others
           capturing the plan's graphs while it captures vLLM's.
Then rank 0 alone joins the check as a rank under elastic EP would: it must not wait for the others.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

rank, world, tp, port = (int(a) for a in sys.argv[1:5])
mode, out = sys.argv[5], Path(sys.argv[6])

sys.path.insert(0, str(Path(__file__).parent))

import runtime_check  # noqa: E402  (puts the oracle on the path, imports vLLM)
from rank_exit import run_then_leave  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import compile_plan  # noqa: E402
from capplan.runtime import registry  # noqa: E402
from capplan.runtime.dp_check import NO_PLAN, agree_across_ranks  # noqa: E402
from capplan.runtime.engine_check import PlanMismatch  # noqa: E402

SPEC = {
    "target": {"vllm": runtime_check.RELEASE.version},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
}
LAST = rank == world - 1

with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=world // tp, backend="gloo"
    )


def build(engine: dict) -> dict:
    """This rank's manager for `engine`: refused (the line), or what it will capture."""
    try:
        manager = runtime_check.model_manager(spec_from_data(engine, "engine").model_dump(mode="json"))
    except PlanMismatch as exc:
        return {"refused": str(exc)}
    in_force = getattr(manager, "_capplan_plan", None) is not None
    return {"refused": None, "plan_in_force": in_force, "graphs": sum(map(len, manager._capture_descs.values()))}


def main() -> dict:
    result: dict = {"rank": rank, "vllm": runtime_check.vllm.__version__, "world": world}
    if mode == "noplan" and LAST:
        registry.install_guard()
    else:
        registry.install(compile_plan(spec_from_data(SPEC, "ranks")), "ranks.plan.yaml")
    result["same"] = build(SPEC)
    if mode == "plan":
        result["refuses"] = build({**SPEC, "lora": {**SPEC["lora"], "max_loras": 8}} if LAST else SPEC)
    if rank == 0:  # under elastic EP the world group is not torch.distributed's: no exchange (alone, no wait)
        agree_across_ranks(NO_PLAN, None, SimpleNamespace(enable_elastic_ep=True))
        result["elastic_ep_alone_returned"] = True
    return result


run_then_leave(lambda: out.write_text(json.dumps(main())))
