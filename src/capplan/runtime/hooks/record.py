"""The trace recorder's hook (CAPPLAN_TRACE): each real step's batch, read after vLLM ran it.

What the step dispatched on comes from the hooks before it in the same step (`Step`):
the LoRA count the lora_slot hook made, and whether vLLM told its dispatcher a prefill
was in the batch; a release or plan without them is read from the runner's own state.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from capplan.releases import RUNNER
from capplan.runtime import recorder
from capplan.runtime.context import HookContext
from capplan.runtime.dp_check import launch_rank
from capplan.runtime.hooking import Hook, Need, binder, check_attributes


def _records_here() -> bool:
    """Whether this worker records its engine's steps: tensor-parallel rank 0 of the first
    pipeline stage. Every TP worker and every stage runs the same steps, so one of them writes
    the DP rank's file (two would truncate and interleave it). True where vLLM has no groups."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()) == 0 and bool(get_pp_group().is_first_rank)
    except Exception:  # noqa: BLE001 - no group (one GPU, a CPU check): the only rank
        return True


def _open(ctx: HookContext, hook: Hook, runner: Any) -> recorder.Recorder | None:
    """This process's recorder, opened at its first real step (None: this process records nothing)."""
    rec = ctx.recording
    if rec.recorder is not None or rec.off:
        return rec.recorder
    if not _records_here():
        rec.off = True
        return None
    check_attributes(hook, runner)
    header = (
        f"capplan trace: one line per model-runner step of an engine running plan {ctx.plan_path} "
        f"({ctx.plan.fingerprint[:19]}); read by capplan simulate / optimize / dispatch --queries"
    )
    rec.recorder = recorder.open_recorder(
        launch_rank(runner.parallel_config),
        ctx.plan.spec.parallel.data_parallel_size,  # the launch's: a dense model's engines hold 1
        header + recorder.layout_note(runner.parallel_config),
    )
    ctx.report.recorder = rec.recorder
    rec.off = rec.recorder is None
    return rec.recorder


def _execute_model(ctx: HookContext, hook: Hook, original: Any) -> Any:
    bind = binder(original)
    step = ctx.step

    @functools.wraps(original)
    def execute_model(*args: Any, **kwargs: Any) -> Any:
        call = bind(args, kwargs)
        step.start()
        result = original(*args, **kwargs)
        started = time.perf_counter()
        runner, scheduler_output = call["self"], call["scheduler_output"]
        counts = scheduler_output.num_scheduled_tokens
        if call["dummy_run"] or not counts or all(r.startswith(recorder.WARMUP_PREFIXES) for r in counts):
            return result  # dummy runs and vLLM's start-up warm-up requests are no traffic
        rec = _open(ctx, hook, runner)
        if rec is None:
            return result
        adapters, base = 0, False
        if step.lora is not None:  # counted this step by the lora_slot hook
            adapters, base = step.lora
        elif runner.lora_config:
            req_ids = list(counts)
            lora_state = runner.lora_state
            adapters = len(lora_state.get_activate_loras(req_ids))
            base = any(r not in lora_state.lora_requests for r in req_ids)
        max_q = max(counts.values())
        prefill = step.has_prefill
        if prefill is None:
            prefill = max_q > runner.decode_query_len
        rec.step(len(counts), scheduler_output.total_num_scheduled_tokens, max_q, adapters, base and adapters > 0,
                 prefill, started, step.dp_step if runner.dp_size > 1 else None)  # fmt: skip
        return result

    return execute_model


def _tracing(need: Need) -> bool:
    return bool(need.env.get(recorder.ENV))


HOOKS = (
    Hook(
        "record.step",
        f"{RUNNER}:GPUModelRunner.execute_model",
        "each real step's batch for the trace recorder",
        _execute_model,
        attributes=("lora_config", "dp_rank", "dp_size", "decode_query_len", "parallel_config"),
        reads=("self", "scheduler_output", "dummy_run"),
        when=_tracing,
    ),
)
