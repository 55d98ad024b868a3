"""The encoder graph manager's capture: vLLM's encoder budgets checked against the plan
before any encoder graph is captured; under encoder_lora_eager none is captured, so the
encoder runs eager (vLLM replays encoder graphs only once captured) and tower/connector
LoRA applies (failure class 11)."""

from __future__ import annotations

import functools
from typing import Any

from capplan.releases import Release
from capplan.runtime.context import HookContext
from capplan.runtime.engine_check import PlanMismatch
from capplan.runtime.hooking import Hook, Need, binder, check_attributes
from capplan.runtime.log import log


def _capture(ctx: HookContext, hook: Hook, original: Any) -> Any:
    enc = ctx.plan.encoder
    assert enc is not None
    bind = binder(original)

    @functools.wraps(original)
    def capture(*args: Any, **kwargs: Any) -> Any:
        manager = bind(args, kwargs)["self"]
        check_attributes(hook, manager)
        have = (sorted(manager.token_budgets, reverse=True), manager.max_batch_size, manager.max_frames_per_batch)
        want = (enc.vllm_budgets, enc.max_items, enc.max_frames)
        if have != want:
            raise PlanMismatch(
                f"capplan: {ctx.plan_path} does not match this engine's encoder graphs (budgets {have[0]}, "
                f"{have[1]} items, {have[2]} frames; the plan: {want[0]}, {want[1]}, {want[2]}). Nothing was "
                "captured. Set the spec's multimodal section to the model's and regenerate: capplan compile SPEC"
            )
        if not enc.budgets:
            log.info(
                "plan %s: encoder runs eager, no encoder graphs captured (encoder_lora_eager: tower/connector "
                "LoRA with specialize_active_lora)",
                ctx.plan_path,
            )
            return None
        return original(*args, **kwargs)

    return capture


def _has_encoder_graphs(release: Release) -> bool:
    return release.rules.encoder_graphs


def _plans_encoder(need: Need) -> bool:
    return need.plan.encoder is not None and bool(need.plan.encoder.vllm_budgets)


HOOKS = (
    Hook(
        "encoder.capture",
        "vllm.v1.worker.encoder_cudagraph:EncoderCudaGraphManager.capture",
        "check the encoder budgets against the plan; under encoder_lora_eager capture none (class 11)",
        _capture,
        attributes=("token_budgets", "max_batch_size", "max_frames_per_batch", "graph_pool"),
        reads=("self",),
        releases=_has_encoder_graphs,
        when=_plans_encoder,
    ),
)
