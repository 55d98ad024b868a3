"""Apply a capture plan to vLLM's Model Runner V2.

Installed by the `vllm.general_plugins` entry point (capplan.runtime.plugin)
in every engine and worker process. Each hook checks the signature of the
vLLM function it replaces first and refuses to install on a mismatch, so an
unexpected vLLM fails at start instead of half-way through capture (the failure
classes cited are those of docs/design.md):

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
- `InputBatch.make_dummy` and `GPUModelRunner._dummy_run` (0.25 only,
  `dummy_remainder`): spread the token remainder over the last dummy
  requests, in the inputs and in the dummy run's scheduler output and LoRA
  mapping, on every dummy path: capture, memory profiling, compile warm-up,
  DP idle steps (failure class 5).
- `VllmConfig.compute_hash`: mixes in the plan fingerprint, so the
  torch.compile cache is never shared between different plans (class 9).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import fields

from capplan.errors import EngineRefusal
from capplan.planner.dispatch import Dispatcher
from capplan.releases import Release
from capplan.runtime import contract, recorder
from capplan.runtime.contract import IncompatibleVllm
from capplan.runtime.deferred import Deferred, dummy_mapping
from capplan.runtime.dp_check import NO_PLAN, check_same_plan, plan_identity
from capplan.runtime.engine_check import PlanMismatch, config_problem, engine_problem
from capplan.runtime.report import Report
from capplan.runtime.versions import detect_release, release_problem
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Fix


def _require(target: str, release: Release, fn=None):
    """Check the contract entry for `target` on this release (and `fn`, the function actually
    patched, when it differs from the one the entry names); return the entry."""
    hook = contract.entry(target, release)
    contract.check_signature(hook, release, fn)
    return hook


class Installed:
    """State shared by the hooks of one process."""

    def __init__(self, plan: Plan, plan_path: str) -> None:
        self.plan = plan
        self.plan_path = plan_path
        self.dispatcher = Dispatcher(plan)
        self.report = Report(plan, plan_path)
        self.in_step = False
        self.step_has_prefill: bool | None = None  # what vLLM told its dispatcher (0.28+), per step
        self.step_lora: tuple[int, bool] | None = None  # (adapters, base) the lora_slot hook counted, per step
        self.dp_step = -1  # model-runner steps through DP sync so far, idle and warm-up steps too (alike on every rank)
        self.recording_off = False  # a tensor-parallel worker other than rank 0: it records nothing
        self.in_force = False  # set once the plan's capture list is installed
        self.lora_state_checked = False
        self.recorder: recorder.Recorder | None = None
        self.desc_cls: type = object  # vLLM's BatchExecutionDescriptor, set by install()
        self.vllm_descs: list = []  # the plan's graphs as vLLM descriptors, in plan order
        self.layouts = {
            (g.descriptor.num_tokens, g.dummy.num_reqs, g.descriptor.num_active_loras): g.dummy for g in plan.graphs
        }
        self.deferred: Deferred | None = None  # spec tiers: the graphs captured while serving


_STATE: Installed | None = None


def install(plan: Plan, plan_path: str) -> Installed:
    """Hook vLLM (idempotent per process). Raises IncompatibleVllm on an unsupported vLLM.

    Every hook is checked against the contract table (`runtime/contract.py`) before
    any is installed, so a vLLM that renamed one refuses at import, not mid-capture."""
    global _STATE
    if _STATE is not None:
        return _STATE
    import vllm
    import vllm.v1.worker.gpu.cudagraph_utils as cg
    import vllm.v1.worker.gpu.model_runner as runner_mod
    from vllm.config import VllmConfig

    release = detect_release(vllm.__version__)
    problem = release_problem(plan.spec.target.vllm, vllm.__version__)
    if problem:
        raise IncompatibleVllm(f"capplan: {problem[0]}; {problem[1]}")
    manager_cls = cg.ModelCudaGraphManager
    m = contract.MANAGER
    init_entry = _require(f"{m}._init_candidates", release)
    _require(f"{m}.dispatch", release)
    _require(f"{m}.capture", release)
    count_entry = _require(f"{contract.RUNNER}:get_num_active_loras_for_dispatch", release)
    capture_entry = _require(f"{contract.RUNNER}:create_lora_capture_hook", release)
    _require("vllm.config:VllmConfig.compute_hash", release)
    state = Installed(plan, plan_path)
    if plan.tiers is not None:
        if not release.deferred_capture:
            raise IncompatibleVllm(
                f"capplan: {plan_path} defers graphs (spec tiers), which capplan does not do on vLLM "
                f"{release.version}; remove tiers from the spec and recompile"
            )
        state.deferred = state.report.deferred = Deferred(state)
    state.desc_cls = cg.BatchExecutionDescriptor
    state.vllm_descs = [_to_vllm(state.desc_cls, g.descriptor) for g in plan.graphs]
    state.report.graph_ids = {desc: i for i, desc in enumerate(state.vllm_descs)}

    _hook_init_candidates(state, manager_cls, init_entry)
    _hook_dispatch(state, manager_cls)
    _hook_capture(state, manager_cls, release)
    if plan.spec.has(Fix.lora_slot) and plan.spec.lora.enabled:
        _hook_lora_count(state, runner_mod, count_entry)
    if plan.spec.lora.enabled:
        runner_mod.create_lora_capture_hook = _capture_hook_factory(state, capture_entry)
    if not release.rules.spreads_dummy_remainder and plan.spec.has(Fix.dummy_remainder):
        _spread_make_dummy(release)
        _spread_dummy_run(runner_mod.GPUModelRunner, release)
    _refuse_v1_runner(state, release)
    _check_config_early(state, release)
    _hook_compute_hash(state, VllmConfig)
    _hook_dp_sync(state, manager_cls, runner_mod, release)
    if os.environ.get(recorder.ENV):
        _hook_record(state, runner_mod.GPUModelRunner, release)
    if plan.encoder is not None and plan.encoder.vllm_budgets:
        _hook_encoder_capture(state, release)
    if state.deferred is not None:  # last: it wraps execute_model, which the hooks above check first
        _hook_deferred(state, state.deferred, release)
    _STATE = state
    return state


def _to_vllm(desc_cls, d) -> object:
    """The plan's descriptor as vLLM's BatchExecutionDescriptor (0.25 has no max_query_len)."""
    from vllm.config.compilation import CUDAGraphMode

    kwargs = dict(
        cg_mode=CUDAGraphMode[d.cg_mode],
        num_tokens=d.num_tokens,
        num_reqs=d.num_reqs,
        uniform_token_count=d.uniform_token_count,
        num_active_loras=d.num_active_loras,
    )
    if "max_query_len" in {f.name for f in fields(desc_cls)}:
        kwargs["max_query_len"] = d.max_query_len
    return desc_cls(**kwargs)


def _hook_init_candidates(state: Installed, manager_cls, entry) -> None:
    """Check plan against engine (and across DP ranks), then install the plan's capture
    list, candidate table and LoRA dispatch map in place of vLLM's."""
    plan, plan_path, vllm_descs = state.plan, state.plan_path, state.vllm_descs
    original = manager_cls._init_candidates

    def _init_candidates(self) -> None:
        original(self)  # vLLM's own tables, kept for the report
        contract.check_attributes(entry, self)  # every attribute written below exists on vLLM's side
        vllm_planned = [d for mode in self._capture_descs.values() for d in mode]
        problem = engine_problem(plan, plan_path, self)
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            # Every rank exchanges its verdict before any rank raises: a rank
            # refusing alone would leave the others blocked in a collective.
            _agree_across_dp(plan_identity(plan), problem)
        if problem:
            raise PlanMismatch(problem)  # before anything is captured
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
        state.report.dp_rank = launch_rank(self.vllm_config.parallel_config)
        state.report.planned(vllm_planned_count=len(vllm_planned))
        dp_size = self.vllm_config.parallel_config.data_parallel_size
        where = f", DP rank {state.report.dp_rank} of {dp_size} (all ranks run this plan)" if dp_size > 1 else ""
        if not state.in_force:  # once: from 0.29 vLLM's memory profiling builds a manager of its own first
            print(
                f"capplan: plan {plan_path} in force: capturing {len(vllm_descs)} graphs (vLLM alone: "
                f"{len(vllm_planned)}; fixes: {', '.join(plan.fixes) or 'none'}){where}",
                file=sys.stderr,
            )
        state.in_force = True
        self._capplan_plan = plan_path  # this manager's capture list is the plan's (checked by capture)

    manager_cls._init_candidates = _init_candidates


def _hook_dispatch(state: Installed, manager_cls) -> None:
    """The plan's O(1) dispatcher in place of vLLM's candidate scan."""
    from vllm.config.compilation import CUDAGraphMode

    desc_cls, vllm_descs, report = state.desc_cls, state.vllm_descs, state.report
    lookup, lora_case = state.dispatcher.lookup, state.dispatcher.lora_case
    none_mode = CUDAGraphMode.NONE
    deferred = state.deferred

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None, num_ubatches=1):
        if not self._graphs_captured or num_ubatches != 1:
            kwargs = dict(
                cg_mode=none_mode,
                num_tokens=num_tokens,
                num_reqs=num_reqs,
                num_active_loras=lora_case(num_active_loras),
            )
            if num_ubatches != 1:
                kwargs["num_ubatches"] = num_ubatches
            desc = desc_cls(**kwargs)
        else:
            result = lookup(num_reqs, num_tokens, uniform_token_count, num_active_loras)
            graph_id = result.graph_id
            if graph_id >= 0 and deferred is not None:
                graph_id = deferred.resolve(graph_id)  # not captured yet: its chain's first captured graph
            if graph_id >= 0:
                desc = vllm_descs[graph_id]
            else:
                desc = desc_cls(
                    cg_mode=none_mode,
                    num_tokens=num_tokens,
                    num_reqs=num_reqs,
                    num_active_loras=result.num_active_loras,
                )
        if not state.in_step:  # inside a model-runner step the step wrapper counts what runs
            report.count(desc)
        return desc

    manager_cls.dispatch = dispatch


def _one_capture_stream(release: Release) -> None:
    """Every capture on one CUDA stream. vLLM's `graph_capture` makes a new stream per call,
    which costs nothing when it captures everything in one call at start; but the caching
    allocator keeps blocks per stream, so each later call would start a fresh segment of the
    graph pool instead of reusing it (measured: 34 MiB per deferred graph on a 2-layer model)."""
    import contextlib

    import torch
    import vllm.v1.worker.gpu.cudagraph_utils as cg
    from vllm.distributed.parallel_state import GraphCaptureContext, get_pp_group, get_tp_group

    _require("vllm.v1.worker.gpu.cudagraph_utils:graph_capture", release)
    contexts: dict = {}

    @contextlib.contextmanager
    def graph_capture(device):
        context = contexts.get(str(device))
        if context is None:
            context = contexts[str(device)] = GraphCaptureContext(torch.cuda.Stream(device=device))
        with get_tp_group().graph_capture(context), get_pp_group().graph_capture(context):
            yield context

    cg.graph_capture = graph_capture


def _hook_capture(state: Installed, manager_cls, release: Release) -> None:
    """Time the capture and measure graph memory for the report; refuse to capture a
    list the plan did not install (fail closed)."""
    original = manager_cls.capture
    entry = contract.entry(f"{contract.MANAGER}.capture", release)

    def capture(self, *args, **kwargs):
        contract.check_attributes(entry, self)
        if release.profiling_capture and getattr(self, contract.PROFILING_MARK) is not None:
            # vLLM's memory profiling: a sample of the plan's graphs, on a manager and pool it
            # then discards. Counted apart; the real capture follows on a new manager.
            if getattr(self, "_capplan_plan", None) is None:
                raise PlanNotInForce(
                    f"capplan: vLLM is about to capture CUDA graphs without the plan {state.plan_path} installed "
                    "(its graph manager was built another way); refusing, nothing was captured"
                )
            state.report.profiling_started()
            try:
                return original(self, *args, **kwargs)
            finally:
                state.report.profiling_finished(self)
        if getattr(self, "_capplan_plan", None) is None:  # this manager's list is not the plan's: fail closed
            raise PlanNotInForce(
                f"capplan: vLLM is about to capture CUDA graphs without the plan {state.plan_path} installed "
                "(its graph manager was built another way); refusing, nothing was captured"
            )
        deferred = state.deferred
        if deferred is not None and deferred.manager is None:  # start-up: the ready graphs only
            if self.tp_size > 1 or not (self.is_first_pp_rank and self.is_last_pp_rank):
                raise PlanNotInForce(
                    f"capplan: {state.plan_path} defers graphs (spec tiers), which capplan does not do under "
                    "tensor or pipeline parallelism yet; refusing before any graph is captured (remove tiers from "
                    "the spec and recompile)"
                )
            self._capture_descs = deferred.ready_descs(state.vllm_descs)
        state.report.capture_started()
        try:
            result = original(self, *args, **kwargs)
        finally:
            state.report.capture_finished(self)
        if deferred is not None and deferred.manager is None:
            deferred.started(self, original, args, kwargs, state.report.graph_memory_bytes)
            contract.check_attributes(
                contract.entry(DUMMY_TABLES, release),
                deferred.block_tables,
            )
        return result

    manager_cls.capture = capture


def _hook_lora_count(state: Installed, runner_mod, entry) -> None:
    """Dispatch on kernel slots (adapters, plus one when base requests share the
    batch), not on adapters: the plan's `lora_slot` fix (failure class 6)."""
    from capplan.planner.lora_cases import kernel_slots

    def get_num_active_loras_for_dispatch(lora_config, lora_state, req_ids, dummy_run):
        if not lora_config:
            return 0
        if dummy_run:
            return lora_config.max_loras + 1
        if not state.lora_state_checked:
            contract.check_attributes(entry, lora_state)
            state.lora_state_checked = True
        adapters = len(lora_state.get_activate_loras(req_ids))
        base = any(r not in lora_state.lora_requests for r in req_ids)
        state.step_lora = (adapters, base)  # the trace recorder's, for this step
        return kernel_slots(adapters, base)

    runner_mod.get_num_active_loras_for_dispatch = get_num_active_loras_for_dispatch


def _hook_compute_hash(state: Installed, config_cls) -> None:
    """Mix the plan fingerprint into vLLM's config hash: the torch.compile cache is
    never shared between different plans (failure class 9)."""
    original = config_cls.compute_hash
    fingerprint = state.plan.fingerprint

    def compute_hash(self, *args, **kwargs) -> str:
        import hashlib

        base = original(self, *args, **kwargs)
        return hashlib.sha256(f"{base}|capplan:{fingerprint}".encode()).hexdigest()[: len(base)]

    config_cls.compute_hash = compute_hash


def _agree_across_dp(identity: str, problem: str | None) -> None:
    from vllm.distributed.parallel_state import get_dp_group

    dp = get_dp_group()
    check_same_plan(identity, problem, dp.cpu_group, f" (DP rank {dp.rank_in_group})")


def _hook_dp_sync(state: Installed, manager_cls, runner_mod, release: Release) -> None:
    """Count what each model-runner step really runs, and what DP sync did to it.

    vLLM's model runner calls `dispatch_cg_and_sync_dp`: a local dispatch,
    then with DP > 1 an all-reduce of token counts and modes and a second
    dispatch for the agreed (padded) token count with this rank's own LoRA
    count. Only the final descriptor runs, so only it is counted; the DP
    wrapper records whether another rank's batch set the padded size and
    whether the ranks ran eager together. With CAPPLAN_DP_AUDIT=1 each step
    also all-reduces the padded token count and counts graph steps where the
    ranks disagreed (there must be none; the plan's verify proves it, this checks it).
    """
    import os

    import vllm.v1.worker.gpu.dp_utils as dp_utils

    _require("vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp", release)
    _require("vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding", release)
    original_step = runner_mod.dispatch_cg_and_sync_dp
    original_sync = dp_utils.sync_cudagraph_and_dp_padding
    report = state.report
    audit = os.environ.get("CAPPLAN_DP_AUDIT") == "1"

    def dispatch_cg_and_sync_dp(cudagraph_manager, *args, **kwargs):
        state.dp_step += 1  # every rank makes this call (an all-reduce under DP) at every step
        if not isinstance(cudagraph_manager, manager_cls):
            return original_step(cudagraph_manager, *args, **kwargs)
        state.in_step = True
        if "max_query_len" in kwargs:  # 0.28+: None when a prefill is in the batch
            state.step_has_prefill = kwargs["max_query_len"] is None
        try:
            result = original_step(cudagraph_manager, *args, **kwargs)
        finally:
            state.in_step = False
        if result[0].num_tokens:  # 0: every DP rank was idle, nothing runs
            report.count(result[0])
        return result

    def sync_cudagraph_and_dp_padding(
        cudagraph_manager, desired, num_tokens, num_reqs, uniform_token_count, dp_size, dp_rank, *args, **kwargs
    ):
        result = original_sync(
            cudagraph_manager, desired, num_tokens, num_reqs, uniform_token_count, dp_size, dp_rank, *args, **kwargs
        )
        if cudagraph_manager is None or isinstance(cudagraph_manager, manager_cls):
            synced = result[0]
            disagreed = None
            if audit:
                import torch
                import torch.distributed as dist

                both = torch.tensor([synced.num_tokens, -synced.num_tokens], dtype=torch.int64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dp_utils.get_dp_group().cpu_group)
                if synced.cg_mode.name != "NONE":  # eager together keeps per-rank counts, by design
                    disagreed = int(both[0]) != -int(both[1])
            report.dp_step(dp_rank, dp_size, num_tokens, desired, synced, disagreed)
        return result

    runner_mod.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp
    dp_utils.sync_cudagraph_and_dp_padding = sync_cudagraph_and_dp_padding


def launch_rank(parallel_config) -> int:
    """This engine's DP rank in the launch: `data_parallel_index`, which vLLM sets for every
    engine (a dense model's independent engines all hold data_parallel_rank 0)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index) if type(index) is int else int(getattr(parallel_config, "data_parallel_rank", 0) or 0)


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM has no TP group here)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no group (one GPU, a CPU check): the only rank
        return 0


def _hook_record(state: Installed, runner_cls, release: Release) -> None:
    """Append each real step's batch to the trace (CAPPLAN_TRACE), read after vLLM ran it."""
    entry = _require(f"{contract.RUNNER}:GPUModelRunner.execute_model", release)
    original = runner_cls.execute_model
    header = (
        f"capplan trace: one line per model-runner step of an engine running plan {state.plan_path} "
        f"({state.plan.fingerprint[:19]}); read by capplan simulate / optimize / dispatch --queries"
    )

    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        state.step_has_prefill = state.step_lora = None
        result = original(self, scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        counts = scheduler_output.num_scheduled_tokens
        if dummy or not counts or all(r.startswith(recorder.WARMUP_PREFIXES) for r in counts):
            return result  # dummy runs and vLLM's start-up warm-up requests are no traffic
        rec = state.recorder
        if rec is None:
            if state.recording_off:
                return result
            if _tensor_parallel_rank() != 0:  # every TP worker runs the same steps: rank 0 records them
                state.recording_off = True
                return result
            contract.check_attributes(entry, self)
            rec = state.recorder = recorder.open_recorder(
                launch_rank(self.parallel_config),
                state.plan.spec.parallel.data_parallel_size,  # the launch's: a dense model's engines hold 1
                header + recorder.layout_note(self.parallel_config),
            )
            state.report.recorder = rec
            if rec is None:
                return result
        adapters, base = 0, False
        if state.step_lora is not None:  # counted this step by the lora_slot hook
            adapters, base = state.step_lora
        elif self.lora_config:
            req_ids = list(counts)
            lora_state = self.lora_state
            adapters = len(lora_state.get_activate_loras(req_ids))
            base = any(r not in lora_state.lora_requests for r in req_ids)
        max_q = max(counts.values())
        prefill = state.step_has_prefill
        if prefill is None:
            prefill = max_q > self.decode_query_len
        rec.step(len(counts), scheduler_output.total_num_scheduled_tokens, max_q, adapters, base and adapters > 0,
                 prefill, started, state.dp_step if self.dp_size > 1 else None)  # fmt: skip
        return result

    runner_cls.execute_model = execute_model


def _hook_encoder_capture(state: Installed, release: Release) -> None:
    """Check vLLM's encoder budgets against the plan before any encoder graph is captured;
    under encoder_lora_eager capture none, so the encoder runs eager (vLLM replays encoder
    graphs only once captured) and tower/connector LoRA applies (failure class 11)."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    target = "vllm.v1.worker.encoder_cudagraph:EncoderCudaGraphManager.capture"
    entry = _require(target, release)
    original = EncoderCudaGraphManager.capture
    enc = state.plan.encoder
    assert enc is not None

    def capture(self, graph_pool):
        contract.check_attributes(entry, self)
        have = (sorted(self.token_budgets, reverse=True), self.max_batch_size, self.max_frames_per_batch)
        want = (enc.vllm_budgets, enc.max_items, enc.max_frames)
        if have != want:
            raise PlanMismatch(
                f"capplan: {state.plan_path} does not match this engine's encoder graphs (budgets {have[0]}, "
                f"{have[1]} items, {have[2]} frames; the plan: {want[0]}, {want[1]}, {want[2]}). Nothing was "
                "captured. Set the spec's multimodal section to the model's and regenerate: capplan compile SPEC"
            )
        if not enc.budgets:
            print(
                f"capplan: plan {state.plan_path}: encoder runs eager, no encoder graphs captured "
                "(encoder_lora_eager: tower/connector LoRA with specialize_active_lora)",
                file=sys.stderr,
            )
            return None
        return original(self, graph_pool)

    EncoderCudaGraphManager.capture = capture


def install_dp_guard() -> None:
    """For a process with no plan: take part in the DP plan check, saying "no plan".

    Without this, a DP rank launched without CAPPLAN_PLAN would never join the
    all-gather and the ranks that have a plan would wait forever. Does
    nothing for DP size 1; never changes what vLLM captures or dispatches.
    """
    import vllm
    import vllm.v1.worker.gpu.cudagraph_utils as cg

    manager_cls = cg.ModelCudaGraphManager
    if getattr(manager_cls._init_candidates, "_capplan_guard", False):
        return
    contract.check_signature(contract.CONTRACT[0], detect_release(vllm.__version__))
    original = manager_cls._init_candidates

    def _init_candidates(self) -> None:
        original(self)
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            _agree_across_dp(NO_PLAN, None)

    _init_candidates._capplan_guard = True  # type: ignore[attr-defined]  # marks the wrapper as installed
    manager_cls._init_candidates = _init_candidates


def _capture_hook_factory(state: Installed, hook_entry):
    def create_lora_capture_hook(lora_config, runner):
        if lora_config is None:
            return None
        contract.check_attributes(hook_entry, runner)
        if state.deferred is not None:
            state.deferred.runner = runner  # a deferred LoRA graph sets its dummy mapping through it
        from vllm.lora.request import LoRARequest

        def hook(num_active_loras: int, num_reqs: int, num_tokens: int) -> None:
            layout = state.layouts.get((num_tokens, num_reqs, num_active_loras))
            if layout is None:
                raise RuntimeError(
                    f"capplan: no dummy layout in {state.plan_path} for a {num_tokens}-token, "
                    f"{num_reqs}-request graph of LoRA case {num_active_loras}"
                )
            prompt, token = dummy_mapping(layout, num_reqs)
            requests = {
                LoRARequest(lora_name=f"warmup_{i}", lora_int_id=int(i), lora_path="/not/a/real/path")
                for i in sorted(set(prompt.tolist()) - {0})
            }
            runner._set_active_loras(tuple(prompt.tolist()), tuple(token.tolist()), requests)

        return hook

    return create_lora_capture_hook


def _hook_deferred(state: Installed, deferred: Deferred, release: Release) -> None:
    """Deferred capture (spec tiers): hook the step start, the async output thread and the
    engine core's idle loop (the capture and dispatch hooks read `state.deferred`)."""
    import vllm.v1.worker.gpu.async_utils as async_utils
    import vllm.v1.worker.gpu.model_runner as runner_mod

    runner_cls = runner_mod.GPUModelRunner
    _require(f"{contract.RUNNER}:GPUModelRunner.execute_model", release)  # dummy_run is its 4th parameter
    _require(DUMMY_TABLES, release)
    step_entry = _require(f"{contract.RUNNER}:GPUModelRunner.sample_tokens", release)
    _require("vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output", release)
    mapping_entry = _require("vllm.lora.model_manager:LoRAModelManager._set_adapter_mapping", release)
    original_step = runner_cls.execute_model
    checked: list[bool] = []

    @functools.wraps(original_step)
    def execute_model(self, scheduler_output, *args, **kwargs):
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        if not dummy and deferred.pending:
            if not checked:
                contract.check_attributes(step_entry, self)
                if self.lora_config:
                    contract.check_attributes(mapping_entry, self.lora_manager._adapter_manager)
                checked.append(True)
            deferred.before_step(self)
        return original_step(self, scheduler_output, *args, **kwargs)

    runner_cls.execute_model = execute_model

    for name in ("AsyncOutput", "AsyncPoolingOutput"):  # both wait on a copy event in the output thread
        _require(f"vllm.v1.worker.gpu.async_utils:{name}.get_output", release)
        output_cls = getattr(async_utils, name)
        output_cls.get_output = _locked(output_cls.get_output, deferred.lock)
    _one_capture_stream(release)
    _hook_idle_loop(state, release)


DUMMY_TABLES = "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables"


def _locked(original, lock):
    """`original` run under `lock`: never while a graph is being captured (CUDA's global
    capture mode fails another thread's event waits)."""

    @functools.wraps(original)
    def get_output(self):
        with lock:
            return original(self)

    return get_output


def _hook_idle_loop(state: Installed, release: Release) -> None:
    """In the engine core process: while it has no work and no input waiting, ask every worker
    to capture one deferred graph per turn (collective_rpc), until none is pending."""
    from vllm.v1.engine.core import EngineCoreProc

    target = "vllm.v1.engine.core:EngineCoreProc._process_input_queue"
    entry = _require(target, release)
    original = EngineCoreProc._process_input_queue
    assert state.plan.tiers is not None
    pending = [len(state.plan.tiers.deferred)]

    @functools.wraps(original)
    def _process_input_queue(self):
        # vLLM's own loop blocks on the input queue until a request brings work, handling
        # utility calls (adapter loads, stats) in between: while graphs are pending, this
        # loop takes its place, capturing one graph per turn and handling whatever arrives.
        if pending[0]:
            contract.check_attributes(entry, self)
            announced = False
            while pending[0] and not self.has_work() and self.is_running() and not self.is_sleeping():
                if not self.input_queue.empty():
                    self._handle_client_request(*self.input_queue.get_nowait())
                    continue
                self._notify_idle_state_callbacks()
                with self.aborts_queue.mutex:  # as vLLM's loop: aborts also come through the input queue
                    self.aborts_queue.queue.clear()
                if not announced:
                    print(f"capplan: engine idle: capturing deferred graphs ({pending[0]} pending)", file=sys.stderr)
                    announced = True
                pending[0] = max(self.collective_rpc(capture_when_idle), default=0)
        return original(self)

    EngineCoreProc._process_input_queue = _process_input_queue


def _spread_make_dummy(release: Release) -> None:
    """Before 0.27 vLLM piles the token remainder on the last dummy request; respread it."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    original = InputBatch.make_dummy.__func__
    hook = _require("vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy", release)

    def make_dummy(cls, num_reqs, num_tokens, input_buffers):
        batch = original(cls, num_reqs, num_tokens, input_buffers)
        contract.check_attributes(hook, batch)
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


def spread(counts):
    """Per-request token counts with the same total and length, the remainder one token
    each on the last requests (a list, or a numpy array of the same dtype)."""
    n = len(counts)
    total = int(sum(int(c) for c in counts))
    base, extra = divmod(total, n)
    even = [base] * (n - extra) + [base + 1] * extra
    if isinstance(counts, list):
        return even
    import numpy as np

    return np.array(even, dtype=counts.dtype)


def _spread_dummy_run(runner_cls, release: Release) -> None:
    """Before 0.27, vLLM's `_dummy_run` (memory profiling, compile warm-up, a DP rank's idle step)
    lists its per-request token counts with the remainder on the last request, for the
    dummy scheduler output and the dummy LoRA mapping, while `make_dummy` (hooked above)
    builds the inputs. During a dummy run, both lists are respread, so the three agree."""
    original = runner_cls._dummy_run
    for name in ("_dummy_run", "maybe_dummy_run_with_lora", "execute_model"):
        _require(f"{contract.RUNNER}:GPUModelRunner.{name}", release, getattr(runner_cls, name))

    def _dummy_run(self, num_tokens, *args, **kwargs):
        lora_context, execute = self.maybe_dummy_run_with_lora, self.execute_model

        def maybe_dummy_run_with_lora(lora_config, num_scheduled_tokens, *a, **k):
            return lora_context(lora_config, spread(num_scheduled_tokens), *a, **k)

        def execute_model(scheduler_output, *a, **k):
            counts = scheduler_output.num_scheduled_tokens
            if k.get("dummy_run") and counts:
                scheduler_output.num_scheduled_tokens = dict(zip(counts, spread(list(counts.values()))))
            return execute(scheduler_output, *a, **k)

        names = ("maybe_dummy_run_with_lora", "execute_model")
        own = {name: vars(self)[name] for name in names if name in vars(self)}  # instance attributes, if any
        self.maybe_dummy_run_with_lora, self.execute_model = maybe_dummy_run_with_lora, execute_model
        try:
            return original(self, num_tokens, *args, **kwargs)
        finally:
            for name in names:
                if name in own:
                    setattr(self, name, own[name])
                else:
                    delattr(self, name)

    runner_cls._dummy_run = _dummy_run


def _check_config_early(state: Installed, release: Release) -> None:
    """Compare plan and engine where vLLM's config becomes final, in the process that starts
    the engine (the API server, or the script that builds LLM): a mismatched plan, or an
    engine vLLM puts on its V1 runner, stops the launch there, before any process is
    spawned or any weight loaded, with one line."""
    from vllm.engine.arg_utils import EngineArgs

    _require("vllm.engine.arg_utils:EngineArgs.create_engine_config", release)
    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if not config.use_v2_model_runner:
            raise SystemExit(v1_runner_message(state.plan_path))
        problem = breakable_problem(state.plan, state.plan_path, release)
        if problem:
            raise SystemExit(problem)
        problem = config_problem(state.plan, state.plan_path, config)
        if problem:
            raise SystemExit(problem)
        return config

    EngineArgs.create_engine_config = create_engine_config


def _refuse_v1_runner(state: Installed, release: Release) -> None:
    """Fail closed when vLLM puts the engine on its V1 model runner: none of the hooks
    above apply there, and the engine would serve without the plan."""
    from vllm.v1.worker.gpu_worker import Worker

    hook = _require("vllm.v1.worker.gpu_worker:Worker.init_device", release)
    original = Worker.init_device

    def init_device(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        contract.check_attributes(hook, self)
        if not self.use_v2_model_runner:
            raise PlanNotInForce(v1_runner_message(state.plan_path))
        return result

    Worker.init_device = init_device


def breakable_problem(plan: Plan, plan_path: str, release: Release) -> str | None:
    """The refusal when vLLM's breakable CUDA graphs are on where they change the graphs
    MRV2 captures (a release row's `breakable_pads_requests`: its mixed PIECEWISE graphs),
    or None. Read after the engine config is built: vLLM turns the setting on itself for
    some architectures."""
    import vllm.envs as envs

    if not release.breakable_pads_requests or plan.spec.cudagraph.mode.mixed_mode != "PIECEWISE":
        return None
    if not getattr(envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False):
        return None
    return (
        f"capplan: VLLM_USE_BREAKABLE_CUDAGRAPH is on (set, or turned on by vLLM {release.version} for this "
        f"model), so vLLM {release.version} pads requests in its mixed PIECEWISE graphs, which the plan "
        f"{plan_path} does not plan; refusing to start (set VLLM_USE_BREAKABLE_CUDAGRAPH=0, or remove CAPPLAN_PLAN)"
    )


class PlanNotInForce(EngineRefusal):
    """The engine would run without the plan (another model runner): refused."""


def v1_runner_message(plan_path: str) -> str:
    return (
        f"capplan: vLLM chose its V1 model runner for this engine, where the plan {plan_path} cannot be in "
        "force; refusing to start (run on Model Runner V2: VLLM_USE_V2_MODEL_RUNNER=1, and no feature "
        "MRV2 lacks; or remove CAPPLAN_PLAN to run without a plan)"
    )


def installed() -> Installed | None:
    return _STATE


def capture_when_idle(_worker: object = None) -> int:
    """Run in each worker by the engine core's `collective_rpc` while it is idle: capture one
    deferred graph; return how many are still pending (0 when none, or no plan defers)."""
    state = _STATE
    if state is None or state.deferred is None:
        return 0
    return state.deferred.capture_idle()


__all__ = ["IncompatibleVllm", "PlanNotInForce", "install", "installed"]
