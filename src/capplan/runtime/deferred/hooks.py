"""Deferred capture's entries in the registry (spec tiers).

- `GPUModelRunner.execute_model`: as a real step starts, before its inputs are prepared,
  one deferred graph before every `every_steps`-th step (between steps only:
  `sample_tokens` clears the state `execute_model` sets). With DP ranks that pad to one
  another, vLLM's dummy batches count too (an idle DP rank's step), and each capture is a
  group: every LoRA case of one size, on every DP rank at the same synced step.
- `AsyncOutput.get_output`, `AsyncPoolingOutput.get_output`: the async output thread
  never waits on the GPU while a graph is captured (CUDA's global capture mode fails
  another thread's event waits): both take the capture lock.
- `EngineCoreProc._process_input_queue`, in the engine core process: while the core is
  idle, every worker captures one graph per turn through `collective_rpc`. The loop is
  vLLM's own: while graphs are pending and the core is awake, capplan sets the core's
  `process_input_queue_block` off (vLLM's non-blocking mode, as its elastic-EP
  reconfiguration does), so vLLM's loop makes one pass and its busy loop comes back for
  the next capture; once none is pending, or while the core sleeps, vLLM blocks as before.
- `graph_capture`: every capture on one CUDA stream. vLLM's makes a new stream per call,
  which costs nothing when it captures everything in one call at start; but the caching
  allocator keeps blocks per stream, so each later call would start a fresh segment of the
  graph pool instead of reusing it.
  vLLM's own function still runs around every capture (what each release does there across
  ranks: the TP, PP and, from 0.30.0, DP groups' capture contexts); capplan only makes its
  context's stream, made current inside it, the same one each time.
- Relied on, not replaced: `sample_tokens` and the runner's step state, `gpu_sync_allowed`
  (a capture synchronizes the device between steps, allowed under VLLM_GPU_SYNC_CHECK),
  `BlockTables.get_dummy_block_tables` (the dummy rows, zeroed before a capture),
  `LoRAModelManager._set_adapter_mapping` (a LoRA graph's dummy mapping), and `get_tp_group`,
  `get_pp_group` (the groups over which several ranks vote on what they capture at start).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import replace
from operator import attrgetter
from typing import Any

from capplan.releases import CUDART, RUNNER
from capplan.runtime.context import HookContext, current
from capplan.runtime.deferred.held import HELD_BLOCK_HOOK
from capplan.runtime.deferred.ranks import RANKS_HOOKS
from capplan.runtime.deferred.startup import DUMMY_TABLES_HOOK
from capplan.runtime.hooking import Hook, Need, binder, check_attributes
from capplan.runtime.log import log

SAMPLING = Hook(
    "deferred.sampling",
    f"{RUNNER}:GPUModelRunner.sample_tokens",
    "deferred capture between steps only: execute_model sets execute_model_state, sample_tokens clears it",
    attributes=("execute_model_state", "parallel_config"),
)
LORA_MAPPING = Hook(
    "deferred.lora_mapping",
    "vllm.lora.model_manager:LoRAModelManager._set_adapter_mapping",
    "warm a LoRA graph with the plan's dummy mapping, no adapter loaded or evicted (classes 1, 3, 6)",
    attributes=("lora_index_to_id", "_last_mapping"),
)


def capture_when_idle(_worker: object = None) -> int:
    """Run in each worker by the engine core's `collective_rpc` while it is idle: capture one
    deferred graph; return how many are still pending (0 when none, or no plan defers)."""
    ctx = current()
    if ctx is None or ctx.deferred is None:
        return 0
    return ctx.deferred.capture_idle()


def _step(ctx: HookContext, hook: Hook, original: Any) -> Any:
    deferred = ctx.deferred
    assert deferred is not None
    bind = binder(original)
    checked: list[bool] = []

    @functools.wraps(original)
    def execute_model(*args: Any, **kwargs: Any) -> Any:
        call = bind(args, kwargs)
        ctx.step.warmup = warmup_step(call["scheduler_output"])
        # A DP rank with no work runs vLLM's dummy batch through here: a DP-synced step too.
        if (not call["dummy_run"] or deferred.synced) and deferred.pending:
            runner = call["self"]
            if not checked:
                check_attributes(SAMPLING, runner)
                if runner.lora_config:
                    check_attributes(LORA_MAPPING, runner.lora_manager._adapter_manager)
                checked.append(True)
            deferred.before_step(runner)
        return original(*args, **kwargs)

    return execute_model


def warmup_step(scheduler_output: Any) -> bool:
    """Whether a step is vLLM's own warm-up (after capture, before serving: 0.25.0 on): every
    request it schedules is one of vLLM's warm-up requests (`_v2_mixed_warmup_...`)."""
    ids = getattr(scheduler_output, "num_scheduled_tokens", None)
    return isinstance(ids, dict) and bool(ids) and all(str(i).startswith("_") and "warmup" in str(i) for i in ids)


def _locked(ctx: HookContext, hook: Hook, original: Any) -> Any:
    """`original` run under the capture lock: never while a graph is being captured."""
    deferred = ctx.deferred
    assert deferred is not None
    lock = deferred.lock

    @functools.wraps(original)
    def get_output(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return original(*args, **kwargs)

    return get_output


def _idle_loop(ctx: HookContext, hook: Hook, original: Any) -> Any:
    assert ctx.plan.tiers is not None
    if ctx.plan.spec.parallel.synced_size > 1:
        return original  # DP ranks that pad to one another capture at DP-synced steps only
    pending = [len(ctx.plan.tiers.deferred)]  # as the workers last reported
    # The core's own process_input_queue_block, kept while graphs are pending. Only vLLM's
    # elastic-EP reconfiguration writes it while serving, on MoE DP engines, where tiers are
    # refused at compile.
    own: dict[int, bool] = {}
    bind = binder(original)

    @functools.wraps(original)
    def _process_input_queue(*args: Any, **kwargs: Any) -> Any:
        core = bind(args, kwargs)["self"]
        if pending[0]:
            key = id(core)
            if key not in own:
                check_attributes(hook, core)
                own[key] = core.process_input_queue_block
                log.info(
                    "engine idle: capturing deferred graphs (the plan defers %d; the workers capture those they "
                    "did not make ready at start)",
                    pending[0],
                )
            idle = not core.has_work() and core.is_running() and not core.is_sleeping()
            if idle and core.input_queue.empty():  # input first: vLLM's pass below handles it
                pending[0] = max(core.collective_rpc(capture_when_idle), default=0)
            keep_turning = pending[0] and not core.is_sleeping()
            core.process_input_queue_block = False if keep_turning else own[key]
        return original(*args, **kwargs)

    return _process_input_queue


def _one_capture_stream(ctx: HookContext, hook: Hook, original: Any) -> Any:
    import torch

    streams: dict[str, Any] = {}
    bind = binder(original)

    @functools.wraps(original)
    @contextlib.contextmanager
    def graph_capture(*args: Any, **kwargs: Any) -> Iterator[Any]:
        device = bind(args, kwargs)["device"]
        # vLLM's own graph_capture runs as it is (each parallel group's capture context: custom
        # all-reduce buffer registration, the DP group where the release has it); only the
        # stream it captures on is capplan's one stream per device.
        with original(*args, **kwargs) as context:
            check_attributes(hook, context)
            stream = streams.get(str(device))
            if stream is None:
                stream = streams[str(device)] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream())
            context.stream = stream
            with torch.cuda.stream(stream):
                yield context

    return graph_capture


def _runner(ctx: HookContext, hook: Hook, original: Any) -> Any:
    deferred = ctx.deferred
    assert deferred is not None
    bind = binder(original)

    @functools.wraps(original)
    def capture_model(*args: Any, **kwargs: Any) -> Any:
        # The runner whose LoRA manager warms the deferred LoRA graphs: known before the first
        # idle capture, which can come before any step.
        deferred.runner = bind(args, kwargs)["self"]
        return original(*args, **kwargs)

    return capture_model


def _tiers(need: Need) -> bool:
    return need.plan.tiers is not None


def _profiled(ctx: HookContext, hook: Hook, original: Any) -> Any:
    deferred = ctx.deferred
    assert deferred is not None

    @functools.wraps(original)
    def profile_cudagraph_memory(*args: Any, **kwargs: Any) -> Any:
        estimate = original(*args, **kwargs)
        if estimate and deferred.profiling_extra:
            log.info(
                "vLLM's CUDA-graph memory estimate %.3f GiB (the PIECEWISE graphs it captured, ready or sampled, "
                "and its extrapolation of the FULL ones) + %.3f GiB for the deferred PIECEWISE graphs it did not "
                "capture",
                estimate / 2**30,
                deferred.profiling_extra / 2**30,
            )
            return estimate + deferred.profiling_extra
        return estimate

    return profile_cudagraph_memory


HOOKS = tuple(
    replace(h, when=_tiers)
    for h in (
        Hook(
            "deferred.step",
            f"{RUNNER}:GPUModelRunner.execute_model",
            "deferred capture as a step starts, between steps only",
            _step,
            reads=("self", "scheduler_output", "dummy_run"),
        ),
        SAMPLING,
        Hook(
            "deferred.runner",
            f"{RUNNER}:GPUModelRunner.capture_model",
            "the runner that captures the ready graphs: its LoRA manager warms the deferred LoRA graphs",
            _runner,
            reads=("self",),
        ),
        Hook(
            "deferred.output",
            "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output",
            "the async output thread never waits on the GPU while a graph is captured",
            _locked,
        ),
        Hook(
            "deferred.pooling_output",
            "vllm.v1.worker.gpu.async_utils:AsyncPoolingOutput.get_output",
            "the async output thread never waits on the GPU while a graph is captured",
            _locked,
        ),
        Hook(
            "deferred.sync_allowed",
            "vllm.utils.gpu_sync_debug:gpu_sync_allowed",
            "a capture synchronizes the device between steps: allowed under VLLM_GPU_SYNC_CHECK",
        ),
        DUMMY_TABLES_HOOK,
        HELD_BLOCK_HOOK,
        *RANKS_HOOKS,
        Hook(
            "deferred.held_block_free",
            f"{CUDART}.cudaFree",
            "the held block given back to the driver before each capture",
        ),
        LORA_MAPPING,
        Hook(
            "deferred.one_stream",
            "vllm.v1.worker.gpu.cudagraph_utils:graph_capture",
            "every capture on one stream, so later captures reuse the graph pool's segments (vLLM's own "
            "graph_capture runs around it, on that stream)",
            _one_capture_stream,
            attributes=("stream",),
            reads=("device",),
        ),
        Hook(
            "deferred.profiled_memory",
            f"{RUNNER}:GPUModelRunner.profile_cudagraph_memory",
            "vLLM sizes the KV cache for the whole plan: the bound of the deferred PIECEWISE graphs its profiling "
            "capture left out is added to its CUDA-graph memory estimate",
            _profiled,
            releases=attrgetter("profiling_capture"),
        ),
        Hook(
            "deferred.idle",
            "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
            "capture while the engine core is idle, in every worker through collective_rpc, by vLLM's own loop",
            _idle_loop,
            attributes=(
                "input_queue",
                "has_work",
                "is_running",
                "is_sleeping",
                "collective_rpc",
                "process_input_queue_block",
            ),
            reads=("self",),
        ),
    )
)
