"""Dummy batches with the token remainder spread (the plan's `dummy_remainder`, class 5).

On releases that pile the remainder on the last dummy request (rule
`spreads_dummy_remainder` off), `InputBatch.make_dummy` builds the inputs of every dummy
path (capture, memory profiling, compile warm-up, DP idle steps) and `_dummy_run` lists
the per-request counts again for its scheduler output and its LoRA mapping; all three are
respread, so they agree with the plan's dummy batches.
"""

from __future__ import annotations

import functools
from typing import Any

from capplan.releases import RUNNER, Release
from capplan.runtime.context import HookContext
from capplan.runtime.hooking import Hook, Need, binder, check_attributes, resolve
from capplan.schemas.spec import Fix

DUMMY_BATCH_FIELDS = (
    "num_scheduled_tokens",
    "query_start_loc_np",
    "query_start_loc",
    "logits_indices",
    "seq_lens_cpu_upper_bound",
)
LORA_CONTEXT = f"{RUNNER}:GPUModelRunner.maybe_dummy_run_with_lora"
STEP = f"{RUNNER}:GPUModelRunner.execute_model"


def spread(counts: Any) -> Any:
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


def _make_dummy(ctx: HookContext, hook: Hook, original: Any) -> Any:
    import numpy as np
    import torch

    bind = binder(original)

    @functools.wraps(original)
    def make_dummy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        call = bind((cls, *args), kwargs)
        batch = original(cls, *args, **kwargs)
        check_attributes(hook, batch)
        num_reqs, num_tokens, input_buffers = call["num_reqs"], call["num_tokens"], call["input_buffers"]
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

    return make_dummy


def _dummy_run(ctx: HookContext, hook: Hook, original: Any) -> Any:
    """During a dummy run, the instance's LoRA context and step see the respread counts."""
    bind_lora = binder(resolve(LORA_CONTEXT))
    bind_step = binder(resolve(STEP))

    @functools.wraps(original)
    def _dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        lora_context, execute = self.maybe_dummy_run_with_lora, self.execute_model

        def maybe_dummy_run_with_lora(*a: Any, **k: Any) -> Any:
            call = bind_lora((self, *a), k)
            call["num_scheduled_tokens"] = spread(call["num_scheduled_tokens"])
            return call.run(lambda _self, *rest, **kw: lora_context(*rest, **kw))

        def execute_model(*a: Any, **k: Any) -> Any:
            call = bind_step((self, *a), k)
            scheduler_output = call["scheduler_output"]
            counts = scheduler_output.num_scheduled_tokens
            if call["dummy_run"] and counts:
                scheduler_output.num_scheduled_tokens = dict(zip(counts, spread(list(counts.values()))))
            return execute(*a, **k)

        names = ("maybe_dummy_run_with_lora", "execute_model")
        own = {name: vars(self)[name] for name in names if name in vars(self)}  # instance attributes, if any
        self.maybe_dummy_run_with_lora, self.execute_model = maybe_dummy_run_with_lora, execute_model
        try:
            return original(self, *args, **kwargs)
        finally:
            for name in names:
                if name in own:
                    setattr(self, name, own[name])
                else:
                    delattr(self, name)

    return _dummy_run


def _piles_remainder(release: Release) -> bool:
    return not release.rules.spreads_dummy_remainder


def _spreads(need: Need) -> bool:
    return need.plan.spec.has(Fix.dummy_remainder)


HOOKS = (
    Hook(
        "dummy.make_dummy",
        "vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy",
        "spread the dummy token remainder under dummy_remainder (class 5)",
        _make_dummy,
        attributes=DUMMY_BATCH_FIELDS,
        reads=("num_reqs", "num_tokens", "input_buffers"),
        releases=_piles_remainder,
        when=_spreads,
    ),
    Hook(
        "dummy.lora_mapping",
        LORA_CONTEXT,
        "the dummy LoRA mapping _dummy_run builds (class 5)",
        reads=("num_scheduled_tokens",),
        releases=_piles_remainder,
        when=_spreads,
    ),
    Hook(
        "dummy.scheduler_output",
        STEP,
        "the dummy scheduler output _dummy_run builds (class 5)",
        reads=("scheduler_output", "dummy_run"),
        releases=_piles_remainder,
        when=_spreads,
    ),
    Hook(
        "dummy.dummy_run",
        f"{RUNNER}:GPUModelRunner._dummy_run",
        "spread the remainder in profile, warm-up and DP idle dummy runs (class 5)",
        _dummy_run,
        releases=_piles_remainder,
        when=_spreads,
    ),
)
