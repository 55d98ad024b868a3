"""The CUDA-graph memory a start leaves free beside the KV cache, from a calibration of the
deployment instead of vLLM's throwaway profiling capture.

From 0.29.0 vLLM sizes the KV cache by capturing a sample of the graphs once, discarding
them, and extrapolating (`profile_cudagraph_memory`); then it captures the real set. At
Llama-3.1-8B's shape on an H100 that pass took about 20 s, and its estimate (1.21 GiB) was 1.6%
above what the same plan's graphs took when captured first (1.1914 GiB): capture is paid twice,
and the estimate is close. A calibration holds what the plan's own starts measured (the fall in
the GPU's free memory across the real capture, identical to the byte across starts of one plan
on one GPU model). Where it measured this plan on this deployment, the reserve is the largest of
those starts plus a stated margin; anywhere else vLLM's own profiling stays in charge, and the
reason is said.

Pure: the engine reads its identity (`runtime.report.deployment_identity`) and asks here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from capplan.schemas.calibration import Calibration, Start
from capplan.schemas.plan import Plan

GIB = 2**30
GRAPH_MARGIN = 0.005
MARGIN_FLOOR_BYTES = 4 * 2**20
"""The default margin: 0.5% of the largest measured graph memory, at least 4 MiB (`show` and
`flags` print the same reserve; `MARGIN_RULE` says it). Nine starts of one plan on one H100 host
whose capture ran first measured the same bytes (1.1914 GiB), and after vLLM's profiling pass
three starts on two H100 hosts a day apart did too (0.3496 GiB); the readings move in 2 MiB pages.
The margin is for a page or two one host could round differently, not for a spread seen: at
Llama-3.1-8B's shape it is 6.1 MiB, three pages, below the 19 MiB by which vLLM's own estimate
exceeded the measure, so the KV cache is not smaller than vLLM alone sizes it. A capture that
outgrows the reserve stops the engine before serving (`outgrown`), naming --graph-margin."""
MARGIN_RULE = f"{GRAPH_MARGIN:.1%}, at least {MARGIN_FLOOR_BYTES // 2**20} MiB"
MAX_MARGIN_GIB = 64.0

# What the engine compares, as the calibration's identity and runtime.report.deployment_identity
# name it: graph memory follows each (the GPU's allocator and kernels, the release's capture
# code, torch's graph pools, the per-rank shapes, the LoRA buffers).
COMPARED = ("gpu", "vllm", "torch", "tensor_parallel_size", "pipeline_parallel_size", "lora_rank")
REQUIRED = ("gpu", "vllm", "torch")  # a calibration that does not say these is no reserve anywhere
SHAPE = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "vocab_size", "num_experts", "dtype")  # fmt: skip


@dataclass(frozen=True)
class GraphBudget:
    """The graph memory a start reserves from a calibration: what the plan's starts measured
    (the largest of them) and the margin on top."""

    source: str  # the calibration's name
    starts: int  # the calibration's starts of this plan
    measured_bytes: int  # the largest graph memory they measured
    spread_bytes: int  # largest minus smallest
    margin_bytes: int

    @property
    def reserve_bytes(self) -> int:
        return self.measured_bytes + self.margin_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "starts": self.starts,
            "measured_gib": round(self.measured_bytes / GIB, 4),
            "spread_gib": round(self.spread_bytes / GIB, 4),
            "margin_gib": round(self.margin_bytes / GIB, 4),
            "reserved_gib": round(self.reserve_bytes / GIB, 4),
        }


def _same_version(have: object, want: object) -> bool:
    """Versions agree; a local build suffix (+cu130) counts only where both sides give one (torch's
    package metadata omits the suffix that torch.__version__ carries)."""
    a, b = str(have), str(want)
    if "+" in a and "+" in b:
        return a == b
    return a.split("+", 1)[0] == b.split("+", 1)[0]


def identity_problem(calibration: Calibration, live: dict[str, Any]) -> str | None:
    """Why this engine is not the deployment the calibration measured (a field it records that
    the engine does not show counts as different: nothing unverified is trusted), or None."""
    ident = calibration.identity
    if ident is None:
        return "it records no identity (model shape, GPU, release): its graph memory could be another deployment's"
    for key in REQUIRED:
        if getattr(ident, key) is None:
            return f"it records no {key}: its graph memory could be another {key}'s"
    for key in COMPARED:
        want = getattr(ident, key)
        if want is None:
            continue
        have = live.get(key)
        same = have is not None and _same_version(have, want) if key in ("vllm", "torch") else have == want
        if not same:
            return f"it measured {key} {want}, this engine has {have if have is not None else 'none known'}"
    backend = live.get("attention_backend")  # the engine shows it only where the operator forced one
    if ident.attention_backend is not None and backend is not None and backend != ident.attention_backend:
        return f"it measured attention backend {ident.attention_backend}, this engine forces {backend}"
    if ident.shape is not None:
        have_shape = live.get("shape") or {}
        for key in SHAPE:
            want = getattr(ident.shape, key)
            if want is not None and have_shape.get(key) != want:
                return f"it measured a model with {key} {want}, this engine's has {have_shape.get(key, 'none known')}"
    elif ident.model is None or ident.model.name is None or ident.model.name != live.get("model"):
        return "it records no model shape, and the model it names is not this engine's"
    return None


def reading_bytes(gib: float) -> int:
    """A report's graph memory (GiB to 4 decimals) as bytes, rounded up to the top of its
    rounding: a reserve never below the capture it was read from."""
    return math.ceil((gib + 0.00005) * GIB)


def default_margin_bytes(measured_bytes: int) -> int:
    """The default margin on `measured_bytes` (`MARGIN_RULE`)."""
    return max(round(measured_bytes * GRAPH_MARGIN), MARGIN_FLOOR_BYTES)


FIRST_CAPTURE_HINT = (
    "a start whose capture runs first measures it: one with the KV cache's size given (--kv-cache-memory-bytes), "
    "where vLLM skips its profiling pass"
)


def plan_starts(plan: Plan, calibration: Calibration) -> tuple[list[Start], str | None]:
    """The calibration's starts of this plan whose capture ran first, or why there are none."""
    if plan.spec.speculative.num_speculative_tokens or plan.encoder is not None:
        return [], (
            "the plan captures speculator or encoder graphs, which a start's reading (the decoder's capture) leaves out"
        )
    mine = [s for s in calibration.starts if s.fingerprint == plan.fingerprint and s.plan_memory]
    if not mine:
        return [], f"it has no start of this plan (fingerprint {plan.fingerprint[7:19]}); calibrate from a start of it"
    first = [s for s in mine if s.after_profiling is False]
    if first:
        return first, None
    after = [s for s in mine if s.after_profiling]
    if after:
        return [], (
            f"its {len(after)} start(s) of this plan captured after vLLM's profiling pass, whose reading "
            f"({max(s.graph_memory_gib for s in after):.4f} GiB) leaves out what that pass left allocated; "
            + FIRST_CAPTURE_HINT
        )
    return [], (
        f"its {len(mine)} start(s) of this plan do not say whether their capture followed vLLM's profiling pass "
        "(reports of an older runtime); calibrate-start again from reports of this capplan"
    )


def graph_budget(
    plan: Plan, calibration: Calibration, live: dict[str, Any], margin_gib: float | None = None
) -> GraphBudget | str:
    """The reserve for this plan on this engine, or why the calibration cannot give one (then
    vLLM's own profiling sizes the KV cache). `margin_gib` None: the default margin (`MARGIN_RULE`)."""
    if plan.tiers is not None:
        return "the plan defers graphs (tiers): deferred capture sizes its own reserve"
    mine, why = plan_starts(plan, calibration)
    if why is not None:
        return why
    problem = identity_problem(calibration, live)
    if problem is not None:
        return problem
    sizes = [reading_bytes(s.graph_memory_gib) for s in mine]
    if margin_gib is not None and not (math.isfinite(margin_gib) and 0 <= margin_gib <= MAX_MARGIN_GIB):
        return f"the margin {margin_gib!r} GiB is not between 0 and {MAX_MARGIN_GIB:g}"
    return GraphBudget(
        source=calibration.name,
        starts=len(mine),
        measured_bytes=max(sizes),
        spread_bytes=max(sizes) - min(sizes),
        margin_bytes=default_margin_bytes(max(sizes)) if margin_gib is None else round(margin_gib * GIB),
    )


def outgrown(budget: GraphBudget, used_bytes: int) -> str | None:
    """The one line that stops an engine whose real capture took more than was left, or None."""
    if used_bytes <= budget.reserve_bytes:
        return None
    return (
        f"capplan: the CUDA graphs took {used_bytes / GIB:.4f} GiB, more than the {budget.reserve_bytes / GIB:.4f} GiB "
        f"left for them beside the KV cache ({budget.measured_bytes / GIB:.4f} GiB measured by calibration "
        f"{budget.source} + {budget.margin_bytes / GIB:.4f} GiB margin); stopping before serving, where it could run "
        "out of memory (calibrate from a start of this deployment, or raise --graph-margin)"
    )


def out_of_memory(budget: GraphBudget) -> str:
    """The one line that stops an engine whose real capture ran out of memory in what was left."""
    return (
        f"capplan: the CUDA-graph capture ran out of GPU memory in the {budget.reserve_bytes / GIB:.4f} GiB left for "
        f"it beside the KV cache ({budget.measured_bytes / GIB:.4f} GiB measured by calibration {budget.source} + "
        f"{budget.margin_bytes / GIB:.4f} GiB margin); stopping before serving (calibrate from a start of this "
        "deployment, or raise --graph-margin)"
    )
