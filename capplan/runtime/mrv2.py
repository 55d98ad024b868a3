"""Apply a capture plan to vLLM's Model Runner V2.

Installed by the `vllm.general_plugins` entry point (capplan.runtime.plugin)
in every engine and worker process. Each hook checks the signature of the
vLLM function it replaces first and refuses to install on a mismatch, so an
unexpected vLLM fails at start instead of half-way through capture:

- `ModelCudaGraphManager._init_candidates`: checks the plan against the live
  config (fingerprint) and, with DP > 1, that every rank loaded the same plan
  (all-gathered over vLLM's DP group), then installs the plan's capture list
  (plan order), LoRA dispatch map and candidate table.
- `ModelCudaGraphManager.dispatch`: the plan's O(1) dispatcher.
- `ModelCudaGraphManager.capture`: timing, graph memory and the report.
- `model_runner.get_num_active_loras_for_dispatch`: kernel slots, not
  adapters, under the plan's `lora_slot` fix (failure class 6).
- `model_runner.create_lora_capture_hook`: each graph is warmed with the
  plan's dummy adapter ids, -1 row included (failure classes 1, 3, 6).
- `InputBatch.make_dummy` (0.25 only, `dummy_remainder`): spreads the token
  remainder over the last dummy requests (failure class 5).
- `VllmConfig.compute_hash`: mixes in the plan fingerprint, so the
  torch.compile cache is never shared between different plans (class 9).
"""

from __future__ import annotations

import inspect
from dataclasses import fields

from capplan.planner.dispatch import Dispatcher
from capplan.runtime.fingerprint import check_engine
from capplan.runtime.report import Report
from capplan.runtime.versions import detect_semantics
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Fix

EXPECTED = {
    "init_candidates": ("self",),
    "dispatch_025": ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
    "dispatch_033": ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras",
                     "max_query_len", "num_ubatches"),
    "count": ("lora_config", "lora_state", "req_ids", "dummy_run"),
    "hook": ("lora_config", "runner"),
    "make_dummy": ("num_reqs", "num_tokens", "input_buffers"),
    "compute_hash_025": ("self",),
    "compute_hash_033": ("self", "include_version"),
}


class IncompatibleVllm(RuntimeError):
    """vLLM is not a version, or not shaped the way, capplan's hooks expect."""


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _require(name: str, fn, expected: tuple[str, ...], prefix_only: bool = False) -> None:
    got = _params(fn)
    ok = got[: len(expected)] == expected if prefix_only else got == expected
    if not ok:
        raise IncompatibleVllm(
            f"capplan: vLLM's {name} has parameters {got}, expected {expected}; "
            "this vLLM is not supported (capplan supports 0.25.x and 0.31-0.33)"
        )


class Installed:
    """State shared by the hooks of one process."""

    def __init__(self, plan: Plan, plan_path: str) -> None:
        self.plan = plan
        self.plan_path = plan_path
        self.dispatcher = Dispatcher(plan)
        self.report = Report(plan, plan_path)
        self.layouts = {
            (g.descriptor.num_tokens, g.dummy.num_reqs, g.descriptor.num_active_loras): g.dummy
            for g in plan.graphs
        }


_STATE: Installed | None = None


def install(plan: Plan, plan_path: str) -> Installed:
    """Hook vLLM (idempotent per process). Raises IncompatibleVllm on an unsupported vLLM."""
    global _STATE
    if _STATE is not None:
        return _STATE
    import vllm
    import vllm.v1.worker.gpu.cudagraph_utils as cg
    import vllm.v1.worker.gpu.model_runner as runner_mod
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    semantics = detect_semantics(vllm.__version__)
    if semantics != plan.spec.target.vllm:
        raise IncompatibleVllm(
            f"capplan: plan targets vLLM {plan.spec.target.vllm} semantics but this is vLLM "
            f"{vllm.__version__} ({semantics}); regenerate the plan with target.vllm: \"{semantics}\""
        )
    manager_cls = cg.ModelCudaGraphManager
    _require("CudaGraphManager._init_candidates", cg.CudaGraphManager._init_candidates, EXPECTED["init_candidates"])
    dispatch_expected = EXPECTED["dispatch_025" if semantics == "0.25" else "dispatch_033"]
    _require("CudaGraphManager.dispatch", cg.CudaGraphManager.dispatch, dispatch_expected)
    _require("get_num_active_loras_for_dispatch", runner_mod.get_num_active_loras_for_dispatch, EXPECTED["count"])
    _require("create_lora_capture_hook", runner_mod.create_lora_capture_hook, EXPECTED["hook"])
    _require("VllmConfig.compute_hash", VllmConfig.compute_hash,
             EXPECTED["compute_hash_025" if semantics == "0.25" else "compute_hash_033"])
    state = Installed(plan, plan_path)
    desc_cls = cg.BatchExecutionDescriptor
    desc_fields = {f.name for f in fields(desc_cls)}

    def to_vllm(d) -> object:
        kwargs = dict(cg_mode=CUDAGraphMode[d.cg_mode], num_tokens=d.num_tokens, num_reqs=d.num_reqs,
                      uniform_token_count=d.uniform_token_count, num_active_loras=d.num_active_loras)
        if "max_query_len" in desc_fields:
            kwargs["max_query_len"] = d.max_query_len
        return desc_cls(**kwargs)

    vllm_descs = [to_vllm(g.descriptor) for g in plan.graphs]
    state.vllm_descs = vllm_descs
    original_init_candidates = manager_cls._init_candidates

    def _init_candidates(self) -> None:
        original_init_candidates(self)  # vLLM's own tables, kept for the report
        vllm_planned = [d for mode in self._capture_descs.values() for d in mode]
        check_engine(plan, plan_path, self)  # raises before anything is captured
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            from vllm.distributed.parallel_state import get_dp_group

            from capplan.runtime.dp_check import check_same_plan, plan_identity

            dp = get_dp_group()
            check_same_plan(plan_identity(plan), dp.cpu_group, f" (DP rank {dp.rank_in_group})")
        self._capture_descs = {}
        for desc in vllm_descs:  # plan order: PIECEWISE then FULL, largest first
            self._capture_descs.setdefault(desc.cg_mode, []).append(desc)
        self._candidates = {}
        for row in plan.dispatch:
            cands = [vllm_descs[i] for i in row.candidates]
            for n in range(row.lo, row.hi + 1):
                self._candidates[(n, row.lora_case)] = cands
        self._lora_dispatch_map = dict(plan.lora_dispatch_map)
        self._max_lora_case = max(plan.lora_dispatch_map.values(), default=0)
        state.report.planned(vllm_planned_count=len(vllm_planned))

    manager_cls._init_candidates = _init_candidates

    lookup = state.dispatcher.lookup
    none_mode = CUDAGraphMode.NONE

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):
        if not self._graphs_captured or num_ubatches != 1:
            state.report.eager += 1
            kwargs = dict(cg_mode=none_mode, num_tokens=num_tokens, num_reqs=num_reqs,
                          num_active_loras=state.dispatcher.lora_case(num_active_loras))
            if num_ubatches != 1:
                kwargs["num_ubatches"] = num_ubatches
            return desc_cls(**kwargs)
        result = lookup(num_reqs, num_tokens, uniform_token_count, num_active_loras)
        if result.graph_id >= 0:
            state.report.hit(result.graph_id)
            return vllm_descs[result.graph_id]
        state.report.eager += 1
        return desc_cls(cg_mode=none_mode, num_tokens=num_tokens, num_reqs=num_reqs,
                        num_active_loras=result.num_active_loras)

    manager_cls.dispatch = dispatch

    original_capture = manager_cls.capture

    def capture(self, *args, **kwargs):
        state.report.capture_started()
        try:
            return original_capture(self, *args, **kwargs)
        finally:
            state.report.capture_finished(self)

    manager_cls.capture = capture

    if plan.spec.has(Fix.lora_slot) and plan.spec.lora.enabled:
        from capplan.planner.lora_cases import kernel_slots

        def get_num_active_loras_for_dispatch(lora_config, lora_state, req_ids, dummy_run):
            if not lora_config:
                return 0
            if dummy_run:
                return lora_config.max_loras + 1
            adapters = len(lora_state.get_activate_loras(req_ids))
            base = any(r not in lora_state.lora_requests for r in req_ids)
            return kernel_slots(adapters, base)

        runner_mod.get_num_active_loras_for_dispatch = get_num_active_loras_for_dispatch

    if plan.spec.lora.enabled:
        runner_mod.create_lora_capture_hook = _capture_hook_factory(state)

    if semantics == "0.25" and plan.spec.has(Fix.dummy_remainder):
        _spread_make_dummy()

    original_hash = VllmConfig.compute_hash

    def compute_hash(self, *args, **kwargs) -> str:
        import hashlib

        base = original_hash(self, *args, **kwargs)
        return hashlib.sha256(f"{base}|capplan:{plan.fingerprint}".encode()).hexdigest()[: len(base)]

    VllmConfig.compute_hash = compute_hash
    _STATE = state
    return state


def _capture_hook_factory(state: Installed):
    def create_lora_capture_hook(lora_config, runner):
        if lora_config is None:
            return None
        import numpy as np
        from vllm.lora.request import LoRARequest

        def hook(num_active_loras: int, num_reqs: int, num_tokens: int) -> None:
            layout = state.layouts.get((num_tokens, num_reqs, num_active_loras))
            if layout is None:
                raise RuntimeError(
                    f"capplan: no dummy layout in {state.plan_path} for a {num_tokens}-token, "
                    f"{num_reqs}-request graph of LoRA case {num_active_loras}"
                )
            per_req = np.array([t for count, t in layout.tokens for _ in range(count)], dtype=np.int32)
            ids = layout.lora_ids or [-1]
            # vLLM's prompt mapping uses 0 for "no adapter" (-1 once converted for the kernels).
            prompt = np.array([max(ids[i % len(ids)], 0) for i in range(num_reqs)], dtype=np.int32)
            token = np.repeat(prompt, per_req)
            requests = {
                LoRARequest(lora_name=f"warmup_{i}", lora_int_id=int(i), lora_path="/not/a/real/path")
                for i in sorted(set(prompt.tolist()) - {0})
            }
            runner._set_active_loras(tuple(prompt.tolist()), tuple(token.tolist()), requests)

        return hook

    return create_lora_capture_hook


def _spread_make_dummy() -> None:
    """vLLM 0.25 piles the token remainder on the last dummy request; respread it."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    original = InputBatch.make_dummy.__func__
    _require("InputBatch.make_dummy", InputBatch.make_dummy, EXPECTED["make_dummy"])

    def make_dummy(cls, num_reqs, num_tokens, input_buffers):
        batch = original(cls, num_reqs, num_tokens, input_buffers)
        extra = num_tokens % num_reqs
        if extra <= 1:
            return batch  # nothing piled
        base = num_tokens // num_reqs
        per_req = np.full(num_reqs, base, dtype=np.int32)
        per_req[-extra:] += 1
        batch.num_scheduled_tokens[:] = per_req
        input_buffers.seq_lens[:num_reqs] = torch.from_numpy(per_req).to(input_buffers.seq_lens.device)
        np.cumsum(per_req, out=batch.query_start_loc_np[1:])
        batch.query_start_loc[1:] = torch.from_numpy(batch.query_start_loc_np[1:]).to(batch.query_start_loc.device)
        batch.logits_indices = batch.query_start_loc[1:] - 1
        batch.seq_lens_cpu_upper_bound = torch.from_numpy(per_req.copy())
        return batch

    InputBatch.make_dummy = classmethod(make_dummy)


def installed() -> Installed | None:
    return _STATE


__all__ = ["IncompatibleVllm", "install", "installed"]
