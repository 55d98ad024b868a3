"""Lockstep checks for the multi-process CPU checks of deferred capture (tp_deferred_worker.py,
dp_deferred_worker.py): ranks that must agree all-reduce what they did over a gloo group, and
vLLM's capture is stood in for by what makes a parallel capture a collective."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import deferred_runtime_check as drc
import torch
import torch.distributed as dist
import vllm.v1.worker.gpu.async_utils as async_utils
import vllm.v1.worker.gpu.cudagraph_utils as cg
import vllm.v1.worker.gpu.model_runner as runner_mod

from capplan.loading import spec_from_data
from capplan.planner import compile_plan

VLLM_CAPTURE = cg.ModelCudaGraphManager.capture


class Lockstep:
    """Agreement over `group` (None: the world): each check all-reduces (kind, value), MIN and MAX;
    the ranks agree when both match, and a mismatch is kept. Different kinds for different
    checks make collectives that pair wrongly (one rank capturing, another dispatching) show."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.mismatches: list[str] = []
        self.captured_order: list[int] = []

    def agree(self, kind: int, value: int, what: str) -> None:
        low = torch.tensor([kind, value], dtype=torch.int64)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(low, high):
            self.mismatches.append(f"{what}: ranks differ ({low.tolist()} against {high.tolist()})")

    def capture(self, plan: Any) -> Any:
        """vLLM's capture, stood in for: each graph warmed through the LoRA hook it is given, as
        vLLM's create_forward_fn does, then its address all-reduced over the group (a TP forward
        all-reduces inside a capture, an MoE one runs the expert all-to-all across DP ranks)."""

        @functools.wraps(VLLM_CAPTURE)  # vLLM's signature, which capplan checks and binds by name
        def collective_capture(*args: Any, **kwargs: Any) -> dict:
            arguments = inspect.signature(VLLM_CAPTURE).bind(*args, **kwargs).arguments
            manager = arguments["self"]
            hook = arguments.get("lora_capture_hook")
            for descs in manager._capture_descs.values():
                for desc in descs:
                    if hook is not None:
                        hook(desc.num_active_loras, desc.num_reqs or min(desc.num_tokens, 16), desc.num_tokens)
                    gid = drc.address_of(plan, desc)
                    self.agree(1, gid, f"capture of graph {gid}")
                    self.captured_order.append(gid)
            manager._graphs_captured = True
            return {}

        return collective_capture


def stand_in_gpu(lockstep: Lockstep, step: Any, spec: dict, name: str) -> tuple[Any, Any]:
    """What needs a GPU, stood in for before capplan hooks it: the step's body (`step`), the async
    output, vLLM's memory profiling, and the capture (`lockstep.capture`). The spec and its plan."""
    runner_mod.GPUModelRunner.execute_model = step
    async_utils.AsyncOutput.get_output = drc.fake_get_output
    if drc.RELEASE.profiling_capture:
        runner_mod.GPUModelRunner.profile_cudagraph_memory = drc.fake_profile
    spec_obj = spec_from_data(spec, name)
    plan = compile_plan(spec_obj)
    assert plan.tiers is not None
    cg.ModelCudaGraphManager.capture = lockstep.capture(plan)
    return spec_obj, plan
