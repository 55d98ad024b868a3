"""Check a plan against the engine it is applied to: first against vLLM's final config in
the process that starts the engine (before anything is spawned or loaded), then against
the CUDA-graph manager in each process that captures (the last word: it sees the mode
and LoRA cases the runner really resolved)."""

from __future__ import annotations

from capplan.errors import EngineRefusal
from capplan.schemas.plan import Plan


class PlanMismatch(EngineRefusal):
    """The engine's settings are not the ones the plan was compiled for."""


def engine_settings(manager) -> dict[str, object]:
    """The settings the plan depends on, as the CUDA-graph manager resolved them: its config's,
    with the manager's own mode, decode query length and LoRA capture cases."""
    mode = manager.cudagraph_mode
    return {
        **config_settings(manager.vllm_config),
        "cudagraph.mode": getattr(mode, "name", str(mode)),
        "lora_capture_cases (resolved)": list(manager.lora_capture_cases),
        "speculative.num_speculative_tokens": manager.decode_query_len - 1,
    }


def plan_settings(plan: Plan) -> dict[str, object]:
    spec = plan.spec
    return {
        "scheduler.max_num_seqs": spec.scheduler.max_num_seqs,
        "scheduler.max_num_batched_tokens": spec.scheduler.max_num_batched_tokens,
        "scheduler.max_model_len": spec.scheduler.max_model_len,
        "cudagraph.mode": spec.cudagraph.mode.value,
        "cudagraph.capture_sizes (resolved)": plan.capture_sizes,
        "cudagraph.max_capture_size (resolved)": plan.max_capture_size,
        "lora.enabled": spec.lora.enabled,
        "lora.max_loras": spec.lora.max_loras if spec.lora.enabled else None,
        "lora.specialize": spec.lora.specialize,
        "lora.specialize_active": spec.lora.specialize_active if spec.lora.enabled else False,
        "lora_capture_cases (resolved)": plan.lora_capture_cases,
        "speculative.num_speculative_tokens": spec.speculative.num_speculative_tokens,
        "parallel.data_parallel_size": spec.parallel.data_parallel_size,
        **({"parallel.moe": spec.parallel.moe} if spec.parallel.data_parallel_size > 1 else {}),
        **{
            f"parallel.{name}": getattr(spec.parallel, name)
            for name in ("tensor_parallel_size", "pipeline_parallel_size")
            if getattr(spec.parallel, name) is not None  # unset in the spec: not checked
        },
        **_multimodal_plan(plan),
    }


def _multimodal_plan(plan: Plan) -> dict[str, object]:
    mm = plan.spec.multimodal
    out: dict[str, object] = {"multimodal.tower_connector_lora": bool(mm and mm.tower_connector_lora)}
    if plan.spec.rules.encoder_graphs:  # before 0.28 MRV2 captures no encoder graphs, whatever the flag says
        out["multimodal.encoder_cudagraphs"] = bool(mm and mm.encoder_cudagraphs)
        if mm and mm.encoder_cudagraphs:
            out["multimodal.token_budgets"] = sorted(mm.token_budgets or [])
            out["multimodal.max_vision_items_per_batch"] = mm.max_vision_items_per_batch
            out["multimodal.max_frames_per_batch"] = mm.max_frames_per_batch
    return out


def _same(key: str, want: object, have: object, ours: dict[str, object]) -> bool:
    """Whether the engine's value is the plan's. A dense model's DP ranks are engines of their
    own: vLLM sets data_parallel_size 1 inside each (EngineCoreProc.run_engine_core), so there
    a dense plan's size reads 1; the process that starts them sees the launch's size."""
    if key == "parallel.data_parallel_size" and ours.get("parallel.moe") is False and have == 1:
        return True
    return want == have


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(plan: Plan, manager) -> list[str]:
    ours, theirs = plan_settings(plan), engine_settings(manager)
    out = []
    for key, want in ours.items():
        if key not in theirs:
            continue
        have = theirs[key]
        if key == "lora.specialize" and not ours["lora.enabled"]:
            continue  # irrelevant without LoRA
        if key == "scheduler.max_model_len" and have is None:
            continue  # not visible from this manager
        if not _same(key, want, have, ours):
            out.append(f"{key}: plan {_short(want)}, engine {_short(have)}")
    return out


def engine_problem(plan: Plan, plan_path: str, manager) -> str | None:
    """The one-line refusal for this engine, or None when the plan fits it."""
    diffs = differences(plan, manager)
    if not diffs:
        return None
    return (
        f"capplan: {plan_path} does not match this engine ({'; '.join(diffs)}). Nothing was "
        "captured. Set the spec to the engine's settings and regenerate: capplan compile SPEC"
    )


def config_settings(cfg) -> dict[str, object]:
    """The settings the plan depends on, read off a final VllmConfig (no manager yet)."""
    comp = cfg.compilation_config
    lora = getattr(cfg, "lora_config", None)
    model = getattr(cfg, "model_config", None)
    spec = getattr(cfg, "speculative_config", None)
    mode = comp.cudagraph_mode
    return {
        "scheduler.max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "scheduler.max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "scheduler.max_model_len": getattr(model, "max_model_len", None),
        "cudagraph.mode": getattr(mode, "name", str(mode)),
        "cudagraph.capture_sizes (resolved)": list(comp.cudagraph_capture_sizes or []),
        "cudagraph.max_capture_size (resolved)": comp.max_cudagraph_capture_size or 0,
        "lora.enabled": lora is not None,
        "lora.max_loras": getattr(lora, "max_loras", None),
        "lora.specialize": bool(comp.cudagraph_specialize_lora),
        "lora.specialize_active": bool(getattr(lora, "specialize_active_lora", False)),
        "speculative.num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) or 0,
        "parallel.data_parallel_size": cfg.parallel_config.data_parallel_size,
        "parallel.moe": bool(getattr(model, "is_moe", False)),
        "parallel.tensor_parallel_size": getattr(cfg.parallel_config, "tensor_parallel_size", None),
        "parallel.pipeline_parallel_size": getattr(cfg.parallel_config, "pipeline_parallel_size", None),
        "multimodal.tower_connector_lora": bool(getattr(lora, "enable_tower_connector_lora", False)),
        "multimodal.encoder_cudagraphs": bool(getattr(comp, "cudagraph_mm_encoder", False)),
        "multimodal.token_budgets": sorted(getattr(comp, "encoder_cudagraph_token_budgets", None) or []),
        "multimodal.max_vision_items_per_batch": getattr(comp, "encoder_cudagraph_max_vision_items_per_batch", 0),
        "multimodal.max_frames_per_batch": getattr(comp, "encoder_cudagraph_max_frames_per_batch", None),
    }


def config_problem(plan: Plan, plan_path: str, cfg) -> str | None:
    """The one-line refusal for an engine about to start with this config, or None."""
    ours, theirs = plan_settings(plan), config_settings(cfg)
    diffs = []
    for key, have in theirs.items():
        if key not in ours:
            continue  # a setting this plan does not depend on (encoder budgets without encoder graphs)
        want = ours[key]
        if key == "lora.specialize" and not ours["lora.enabled"]:
            continue
        if not _same(key, want, have, ours):
            diffs.append(f"{key}: plan {_short(want)}, engine {_short(have)}")
    if not diffs:
        return None
    return (
        f"capplan: {plan_path} does not match this engine ({'; '.join(diffs)}). Refused before the engine "
        "started. Set the spec to the engine's settings and regenerate: capplan compile SPEC"
    )
