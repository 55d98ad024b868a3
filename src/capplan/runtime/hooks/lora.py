"""LoRA hooks: what a step dispatches on, and how each LoRA graph is warmed at capture.

- `get_num_active_loras_for_dispatch`: kernel slots (adapters, plus one when base
  requests share the batch), not adapters, under the plan's `lora_slot` fix (class 6).
- `create_lora_capture_hook`: each graph is warmed with the plan's dummy adapter ids,
  -1 row included (failure classes 1, 2, 3, 6).
"""

from __future__ import annotations

import functools
from typing import Any

from capplan.planner.lora_cases import kernel_slots
from capplan.releases import RUNNER
from capplan.runtime.context import HookContext
from capplan.runtime.hooking import Hook, Need, binder, check_attributes
from capplan.runtime.lora_warm import dummy_mapping, layout_for
from capplan.schemas.spec import Fix


def _count(ctx: HookContext, hook: Hook, original: Any) -> Any:
    bind = binder(original)

    @functools.wraps(original)
    def get_num_active_loras_for_dispatch(*args: Any, **kwargs: Any) -> int:
        call = bind(args, kwargs)
        lora_config, lora_state, req_ids = call["lora_config"], call["lora_state"], call["req_ids"]
        if not lora_config:
            return 0
        if call["dummy_run"]:
            return int(lora_config.max_loras) + 1
        if not ctx.lora_state_checked:
            check_attributes(hook, lora_state)
            ctx.lora_state_checked = True
        adapters = len(lora_state.get_activate_loras(req_ids))
        base = any(r not in lora_state.lora_requests for r in req_ids)
        ctx.step.lora = (adapters, base)  # the trace recorder's, for this step
        return kernel_slots(adapters, base)

    return get_num_active_loras_for_dispatch


def _capture_hook(ctx: HookContext, hook: Hook, original: Any) -> Any:
    bind = binder(original)

    @functools.wraps(original)
    def create_lora_capture_hook(*args: Any, **kwargs: Any) -> Any:
        call = bind(args, kwargs)
        lora_config, runner = call["lora_config"], call["runner"]
        if lora_config is None:
            return None
        check_attributes(hook, runner)
        if ctx.deferred is not None:
            ctx.deferred.runner = runner  # a deferred LoRA graph sets its dummy mapping through it
        from vllm.lora.request import LoRARequest

        def warm(num_active_loras: int, num_reqs: int, num_tokens: int) -> None:
            prompt, token = dummy_mapping(layout_for(ctx, num_active_loras, num_reqs, num_tokens), num_reqs)
            requests = {
                LoRARequest(lora_name=f"warmup_{i}", lora_int_id=int(i), lora_path="/not/a/real/path")
                for i in sorted(set(prompt.tolist()) - {0})
            }
            runner._set_active_loras(tuple(prompt.tolist()), tuple(token.tolist()), requests)

        return warm

    return create_lora_capture_hook


def _counts_slots(need: Need) -> bool:
    return need.plan.spec.lora.enabled and need.plan.spec.has(Fix.lora_slot)


def _lora(need: Need) -> bool:
    return need.plan.spec.lora.enabled


HOOKS = (
    Hook(
        "lora.count",
        f"{RUNNER}:get_num_active_loras_for_dispatch",
        "count kernel slots, not adapters, under lora_slot (class 6)",
        _count,
        attributes=("lora_requests",),
        reads=("lora_config", "lora_state", "req_ids", "dummy_run"),
        when=_counts_slots,
    ),
    Hook(
        "lora.capture_hook",
        f"{RUNNER}:create_lora_capture_hook",
        "warm each LoRA graph with the plan's dummy adapter ids, -1 row included (classes 1, 2, 3, 6)",
        _capture_hook,
        attributes=("_set_active_loras",),
        reads=("lora_config", "runner"),
        when=_lora,
    ),
)
