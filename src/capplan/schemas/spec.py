"""The deployment spec: what a user writes in `configs/*.yaml`.

Every field has a default and a description; unknown keys are errors. Field
names are public API: tools script against them. vLLM's own names are given
in each description.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from capplan.errors import printable
from capplan.releases import ALIASES, RELEASES, TARGETS, Rules, rules_of


class CudagraphMode(str, enum.Enum):
    """vLLM's `CompilationConfig.cudagraph_mode` values."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @property
    def separate_routine(self) -> bool:
        """True for the two modes that give uniform-decode batches their own graphs."""
        return self in (CudagraphMode.FULL_DECODE_ONLY, CudagraphMode.FULL_AND_PIECEWISE)

    @property
    def decode_mode(self) -> str:
        return "FULL" if self.separate_routine else self.value

    @property
    def mixed_mode(self) -> str:
        if self is CudagraphMode.FULL_DECODE_ONLY:
            return "NONE"
        if self is CudagraphMode.FULL_AND_PIECEWISE:
            return "PIECEWISE"
        return str(self.value)


class Fix(str, enum.Enum):
    """capplan's deliberate deviations from vLLM (docs/design.md failure classes)."""

    lora_slot = "lora_slot"
    dummy_remainder = "dummy_remainder"
    mixed_ranges = "mixed_ranges"
    prune_unreachable = "prune_unreachable"
    encoder_lora_eager = "encoder_lora_eager"


# The fixes every spec gets by default; encoder_lora_eager is added by default only
# where it applies (a multimodal section with tower LoRA), so other plans never change.
ALL_FIXES: tuple[Fix, ...] = (Fix.lora_slot, Fix.dummy_remainder, Fix.mixed_ranges, Fix.prune_unreachable)
FIX_ORDER: tuple[Fix, ...] = (*ALL_FIXES, Fix.encoder_lora_eager)
MAX_ENCODER_BUDGET = 1 << 22
_FIRST_ENCODER_GRAPHS = next(v for v, r in RELEASES.items() if r.rules.encoder_graphs)  # from the table

# Limits that reject absurd values with a clear message instead of letting a
# typo (max_num_seqs: 2560000) build a plan of millions of lines.
MAX_NUM_SEQS_LIMIT = 16384
MAX_BATCHED_TOKENS_LIMIT = 1 << 20
MAX_MODEL_LEN_LIMIT = 1 << 24
MAX_LORAS_LIMIT = 512
MAX_SPEC_TOKENS = 16
MAX_DP_SIZE = 1024
MAX_CAPTURE_SIZES = 2048


# Names printed to a terminal: no control characters, line or paragraph separators, or
# bidirectional overrides (which reorder what a reader sees).
PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, defer_build=True)


class Target(_Strict):
    """Which runner and which vLLM planning semantics the plan reproduces."""

    runner: Literal["mrv2"] = Field("mrv2", description="Model runner. Only vLLM's Model Runner V2 is supported.")
    vllm: str = Field(
        "0.33",
        description=(
            f"The vLLM release the plan reproduces: {', '.join(RELEASES)}; or an alias kept for older specs, "
            + "; ".join(f"'{a}' (vLLM {', '.join(r)})" for a, r in ALIASES.items())
            + "; a minor version names its one supported release ('0.32': 0.32.0)"
            + ". Releases differ in default capture sizes, token ranges, uniform-decode and dummy layouts "
            "(docs/vllm-releases.md)."
        ),
    )
    blackwell: bool = Field(
        False,
        description=(
            "Data-center Blackwell GPU (SM10x). From vLLM 0.28 the default capture ceiling "
            "is 1024 tokens there instead of 512; ignored by earlier releases."
        ),
    )
    gpu: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=PRINTABLE,
        description=(
            "The GPU the deployment serves on, as torch names it (e.g. 'NVIDIA H200'). Does not change the "
            "plan; estimates from a calibration measured on another GPU are withheld."
        ),
    )

    @field_validator("vllm", mode="before")
    @classmethod
    def _accept_unquoted(cls, value: object) -> object:
        # `vllm: 0.33` unquoted is a YAML float; take it as the string it is written as
        # (0.329 stays "0.329" and is refused, never rounded to a supported version).
        if isinstance(value, float):
            return repr(value)
        return value

    @field_validator("vllm")
    @classmethod
    def _supported(cls, value: str) -> str:
        if value in TARGETS:
            return value
        # "0.32": the minor version names its one supported release; where it has several, say which
        same_minor = [r for r in RELEASES if r.rsplit(".", 1)[0] == value]
        if len(same_minor) == 1:
            return same_minor[0]
        if same_minor:
            raise ValueError("name the release: " + " or ".join(f'"{r}"' for r in same_minor))
        raise ValueError(
            f"not a supported vLLM release: use one of {', '.join(RELEASES)} (or the older aliases "
            f"{' and '.join(ALIASES)})"
        )


class Scheduler(_Strict):
    """vLLM's SchedulerConfig limits (`--max-num-seqs` and friends)."""

    max_num_seqs: int = Field(256, ge=1, le=MAX_NUM_SEQS_LIMIT, description="vLLM max_num_seqs: requests per batch.")
    max_num_batched_tokens: int = Field(
        8192,
        ge=1,
        le=MAX_BATCHED_TOKENS_LIMIT,
        description="vLLM max_num_batched_tokens: tokens per batch (scheduler budget).",
    )
    max_model_len: int = Field(
        4096,
        ge=1,
        le=MAX_MODEL_LEN_LIMIT,
        description="vLLM max_model_len: no dummy request may be longer than this.",
    )

    @model_validator(mode="after")
    def _budget_holds_a_batch(self) -> Scheduler:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires"
            )
        return self


class LoraCaseSizes(_Strict):
    """Capture sizes for one LoRA case (capplan-only; see Cudagraph.lora_case_sizes)."""

    case: int = Field(ge=0, description="A resolved LoRA capture case (0 = no LoRA), as `capplan show` lists them.")
    sizes: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1,
        max_length=MAX_CAPTURE_SIZES,
        description="Sizes captured for this case: a strictly increasing subset of capture_sizes ending at the "
        "largest, so every batch a graph can serve still has one.",
    )


class Cudagraph(_Strict):
    """vLLM's CompilationConfig CUDA-graph settings."""

    mode: CudagraphMode = Field(
        CudagraphMode.FULL_AND_PIECEWISE,
        description="vLLM cudagraph_mode: NONE | PIECEWISE | FULL | FULL_DECODE_ONLY | FULL_AND_PIECEWISE.",
    )
    capture_sizes: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        max_length=MAX_CAPTURE_SIZES,
        description=(
            "vLLM cudagraph_capture_sizes: token counts to capture, strictly increasing. "
            "null: vLLM's default for the target version."
        ),
    )
    max_capture_size: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCHED_TOKENS_LIMIT,
        description=(
            "vLLM max_cudagraph_capture_size. null: vLLM's default "
            "(min(max_num_seqs * (1 + spec tokens) * 2, 512), or the largest capture size)."
        ),
    )
    lora_case_sizes: list[LoraCaseSizes] | None = Field(
        None,
        max_length=64,
        description=(
            "capplan-only (written by `capplan optimize`): capture only these sizes for the listed LoRA "
            "cases; unlisted cases use every capture size. Needs explicit capture_sizes and "
            "data_parallel_size 1 (DP ranks must pad alike). null: every case, every size (vLLM)."
        ),
    )
    performance_mode: Literal["balanced", "interactivity", "throughput"] = Field(
        "balanced",
        description=("vLLM performance_mode. 'interactivity' captures every size 1..32 when capture_sizes is null."),
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_from_str(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return CudagraphMode(value)
            except ValueError:
                allowed = " | ".join(m.value for m in CudagraphMode)
                raise ValueError(f"must be one of {allowed}") from None
        return value

    @field_validator("capture_sizes")
    @classmethod
    def _sorted_unique(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is None:
            return None
        if not sizes:
            raise ValueError("must list at least one size, or be null for vLLM's default")
        for prev, cur in zip(sizes, sizes[1:]):
            if cur <= prev:
                kind = "duplicate" if cur == prev else "unsorted"
                raise ValueError(f"{kind} size {cur} after {prev}; list sizes strictly increasing")
        return sizes

    @model_validator(mode="after")
    def _max_matches_sizes(self) -> Cudagraph:
        if (
            self.capture_sizes is not None
            and self.max_capture_size is not None
            and self.max_capture_size != self.capture_sizes[-1]
        ):
            raise ValueError(
                f"max_capture_size ({self.max_capture_size}) must equal the largest "
                f"capture size ({self.capture_sizes[-1]}), as vLLM requires; drop one of them"
            )
        if self.lora_case_sizes is not None:
            if self.capture_sizes is None:
                raise ValueError("lora_case_sizes needs explicit capture_sizes; list them")
            allowed, seen = set(self.capture_sizes), set()
            for entry in self.lora_case_sizes:
                where = f"lora_case_sizes case {entry.case}"
                if entry.case in seen:
                    raise ValueError(f"{where} is listed twice; list each case once")
                seen.add(entry.case)
                if any(b <= a for a, b in zip(entry.sizes, entry.sizes[1:])):
                    raise ValueError(f"{where}: sizes must be strictly increasing")
                extra = sorted(set(entry.sizes) - allowed)
                if extra:
                    raise ValueError(f"{where}: size {extra[0]} is not in capture_sizes; use a subset of them")
                if entry.sizes[-1] != self.capture_sizes[-1]:
                    raise ValueError(
                        f"{where}: must end at the largest capture size ({self.capture_sizes[-1]}), "
                        "or batches of that case would lose their graphs"
                    )
        return self


class Lora(_Strict):
    """vLLM's LoRAConfig and the LoRA CUDA-graph switches."""

    enabled: bool = Field(False, description="vLLM enable_lora.")
    max_loras: int = Field(1, ge=1, le=MAX_LORAS_LIMIT, description="vLLM max_loras: adapters per batch.")
    specialize: bool = Field(
        True,
        description="vLLM CompilationConfig.cudagraph_specialize_lora: separate graphs per LoRA case.",
    )
    specialize_active: bool = Field(
        False,
        description=(
            "vLLM LoRAConfig.specialize_active_lora: also specialize on the number of "
            "active adapters (powers of two up to max_loras, plus max_loras + 1)."
        ),
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = Field(
        None,
        description=(
            "vLLM max_lora_rank (the ranks vLLM accepts). Changes no graph; the LoRA buffers and kernels the "
            "graphs record follow it, so a calibration of another rank does not price the plan. When given, "
            "`apply` checks the line's and the engine's; null: not given (vLLM's default is 16)."
        ),
    )

    @field_validator("max_lora_rank", mode="before")
    @classmethod
    def _rank_is_an_integer(cls, value: object) -> object:
        if value is not None and type(value) is not int:  # true == 1 and 16.0 == 16 to a Literal
            raise ValueError("must be an integer, one of 1, 8, 16, 32, 64, 128, 256, 320, 512")
        return value


class Speculative(_Strict):
    """vLLM's SpeculativeConfig, as far as it shapes graphs."""

    num_speculative_tokens: int = Field(
        0,
        ge=0,
        le=MAX_SPEC_TOKENS,
        description="Draft tokens per step; a uniform decode request schedules 1 + this many.",
    )


class Parallel(_Strict):
    """vLLM's ParallelConfig, as far as it shapes graphs and dispatch."""

    data_parallel_size: int = Field(1, ge=1, le=MAX_DP_SIZE, description="vLLM data_parallel_size.")
    moe: bool | None = Field(
        None,
        description=(
            "Whether the model is a mixture of experts (vLLM ModelConfig.is_moe); required when "
            "data_parallel_size > 1. vLLM keeps the DP ranks of an MoE model in lockstep (they pad to one "
            "another's token counts: DP sync) and runs those of a dense model as independent engines, each "
            "with data_parallel_size 1, so a dense model's plan is its DP 1 plan."
        ),
    )

    @property
    def synced_size(self) -> int:
        """The DP ranks that pad to one another: data_parallel_size for an MoE model, 1 for a
        dense one (vLLM's independent engines)."""
        return self.data_parallel_size if self.moe else 1

    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        le=MAX_DP_SIZE,
        description=(
            "vLLM tensor_parallel_size. Changes no graph (every TP rank captures the plan's graphs; vLLM's "
            "sequence-parallel size filter needs enable_sp, which capplan does not plan); when given, the "
            "engine must match it and a calibration's estimates must have been measured at it. Unset: "
            'neither is checked (estimates read "not checked").'
        ),
    )
    pipeline_parallel_size: int | None = Field(
        None,
        ge=1,
        le=MAX_DP_SIZE,
        description=(
            "vLLM pipeline_parallel_size. Changes no graph (every stage captures the plan's graphs); when "
            "given, the engine must match it and a calibration's estimates must have been measured at it. "
            'Unset: neither is checked (estimates read "not checked").'
        ),
    )


MAX_READY_LIST = 65536  # graph addresses in tiers.ready: more than any plan file holds graphs
_ADDRESS = r"^(PIECEWISE|FULL):[1-9][0-9]{0,6}(x[1-9][0-9]{0,6})?@[0-9]{1,4}$"


class Tiers(_Strict):
    """Capture tiers: the graphs captured before the engine reports ready, and the rest
    (deferred), captured one at a time between model-runner steps while it serves. Off
    when absent: every graph is captured before the engine reports ready."""

    ready: (
        Literal["full_decode"]
        | Annotated[
            list[Annotated[str, StringConstraints(pattern=_ADDRESS, max_length=40)]],
            Field(min_length=1, max_length=MAX_READY_LIST),
        ]
    ) = Field(
        description=(
            "The graphs captured before the engine reports ready. full_decode: every FULL uniform-decode "
            "graph of every LoRA case; or a list of graph addresses (MODE:TOKENS[xREQUESTS]@CASE, as "
            "capplan show lists them; capplan optimize --ready-share writes one from a trace). The largest "
            "graph of each mode and LoRA case is always ready, so every deferred graph has a captured fallback."
        )
    )
    every_steps: int = Field(
        8,
        ge=1,
        le=1_000_000,
        description=(
            "While the engine serves, capture one deferred graph before every Nth model-runner step "
            "(that step waits for it, when its mode's recent captures took at most 50 ms, and never under "
            "tensor or pipeline parallelism); while it is idle, one after another. With DP ranks that pad to "
            "one another (MoE), every Nth DP-synced step captures every LoRA case of one size, and idle turns "
            "capture nothing."
        ),
    )

    @field_validator("ready", mode="before")
    @classmethod
    def _ready_form(cls, ready: object) -> object:
        """Say what `ready` takes in words, instead of the two types it may have."""
        said = 'name graph addresses (MODE:TOKENS[xREQUESTS]@CASE) or write "full_decode"'
        if isinstance(ready, list):
            if not ready:
                raise ValueError(f"[] names no graph; {said}, or remove tiers")
            if len(ready) > MAX_READY_LIST:
                raise ValueError(f"lists {len(ready)} graphs (at most {MAX_READY_LIST}); write full_decode instead")
            for i, item in enumerate(ready):
                if not isinstance(item, str) or not re.fullmatch(_ADDRESS, item) or len(item) > 40:
                    raise ValueError(f"[{i}] {printable(repr(item))[:50]} is not a graph address; {said}")
            return ready
        if ready != "full_decode":
            raise ValueError(f"neither a list nor full_decode; {said}")
        return ready

    @field_validator("ready")
    @classmethod
    def _distinct(cls, ready: object) -> object:
        if isinstance(ready, list) and len(set(ready)) != len(ready):
            twice = next(a for i, a in enumerate(ready) if a in ready[:i])
            raise ValueError(f"lists {twice} twice; name each graph once")
        return ready


class Model(_Strict):
    """What model a deployment (or a calibration) serves: its identity as a calibration records it.

    Does not change the plan. Estimates (capture time, graph memory, step time) rest on a
    calibration of one model; they are withheld when the calibration is of another.
    """

    name: str | None = Field(
        None, min_length=1, max_length=500, pattern=PRINTABLE, description="Model name or path, as given to vLLM."
    )
    architecture: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=PRINTABLE,
        description="The Hugging Face architecture, e.g. LlamaForCausalLM.",
    )
    parameters: int | None = Field(None, ge=1, le=10**15, description="Parameter count.")
    hidden_size: int | None = Field(None, ge=1, le=1 << 24, description="Hidden size.")
    num_layers: int | None = Field(None, ge=1, le=1 << 16, description="Decoder layers (num_hidden_layers).")
    dtype: str | None = Field(
        None, min_length=1, max_length=50, pattern=PRINTABLE, description="Weight dtype, e.g. bfloat16."
    )


class Deployment(_Strict):
    """The deployment's own vLLM config, read by `capplan compile` as vLLM reads it.

    Every setting the config gives comes from it: the spec does not repeat it (a spec that sets
    one too is refused), so a change to the config makes the checked-in plan stale.
    """

    config: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        pattern=PRINTABLE,
        description="vLLM's --config YAML file, relative to the spec's folder (or absolute).",
    )
    command: str | None = Field(
        None,
        min_length=1,
        max_length=20000,
        pattern=PRINTABLE,
        description=(
            "The line that starts vLLM, as a shell would split it (`vllm serve MODEL --max-loras 4`, or "
            "`python -m vllm.entrypoints.openai.api_server ...`)."
        ),
    )
    script: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        pattern=PRINTABLE,
        description=(
            "A file that holds the line that starts vLLM (a shell script), relative to the spec's folder: its one "
            "line that starts vLLM is read (backslash continuations joined, comments dropped)."
        ),
    )

    @model_validator(mode="after")
    def _one_line(self) -> Deployment:
        if self.config is None and self.command is None and self.script is None:
            raise ValueError("name the deployment's vLLM config: config (a vllm.yaml), command or script")
        if self.command is not None and self.script is not None:
            raise ValueError("give the serve line once: command or script, not both")
        return self


class Multimodal(_Strict):
    """A multimodal model's encoder on MRV2 (vision tower and connector), as far as graphs
    and LoRA are concerned. The model's own encoder CUDA-graph limits (its
    `get_encoder_cudagraph_budget_range` and `max_frames_per_video`) are given here,
    since capplan reads no model."""

    tower_connector_lora: bool = Field(
        False, description="vLLM LoRAConfig.enable_tower_connector_lora: LoRA on the vision tower and connector."
    )
    encoder_cudagraphs: bool = Field(
        False,
        description="vLLM CompilationConfig.cudagraph_mm_encoder: CUDA graphs for the encoder (MRV2 from "
        f"{_FIRST_ENCODER_GRAPHS}, capplan.releases).",
    )
    token_budgets: list[Annotated[int, Field(ge=1, le=MAX_ENCODER_BUDGET)]] | None = Field(
        None,
        max_length=64,
        description="vLLM encoder_cudagraph_token_budgets; null: powers of two over the model's budget range.",
    )
    max_vision_items_per_batch: int = Field(
        0, ge=0, le=MAX_ENCODER_BUDGET, description="vLLM encoder_cudagraph_max_vision_items_per_batch; 0: auto."
    )
    max_frames_per_batch: int | None = Field(
        None, ge=0, le=MAX_ENCODER_BUDGET, description="vLLM encoder_cudagraph_max_frames_per_batch; null: auto."
    )
    budget_range: list[Annotated[int, Field(ge=1, le=MAX_ENCODER_BUDGET)]] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description=(
            "The model's encoder token budget range [min, max] (its get_encoder_cudagraph_budget_range); "
            "needed unless token_budgets and max_vision_items_per_batch are both given."
        ),
    )
    video: bool = Field(False, description="Video inputs allowed (limit_mm_per_prompt video > 0).")
    max_frames_per_video: int = Field(
        0, ge=0, le=MAX_ENCODER_BUDGET, description="The model's max_frames_per_video (video, frames auto only)."
    )

    @model_validator(mode="after")
    def _budgets_resolvable(self) -> Multimodal:
        if not self.encoder_cudagraphs:
            return self
        explicit = self.token_budgets is not None and self.max_vision_items_per_batch > 0
        if not explicit and self.budget_range is None:
            raise ValueError(
                "encoder_cudagraphs needs budget_range (the model's encoder token budget range) unless "
                "token_budgets and max_vision_items_per_batch are both given; add budget_range: [MIN, MAX]"
            )
        if self.budget_range is not None and self.budget_range[0] > self.budget_range[1]:
            raise ValueError(f"budget_range {list(self.budget_range)}: min above max; swap them")
        if self.token_budgets is not None and not self.token_budgets:
            raise ValueError("token_budgets: [] lists no budget; leave it out for the model's own, or list them")
        if self.token_budgets is not None and len(set(self.token_budgets)) != len(self.token_budgets):
            raise ValueError("token_budgets lists a budget twice; list each once")
        if explicit and self.token_budgets and self.max_vision_items_per_batch > min(self.token_budgets):
            raise ValueError(
                f"max_vision_items_per_batch ({self.max_vision_items_per_batch}) must be <= the smallest token "
                f"budget ({min(self.token_budgets)}), as vLLM requires; lower it or raise the smallest budget"
            )
        if self.video and self.max_frames_per_batch is None and self.max_frames_per_video == 0:
            raise ValueError("video with auto max_frames_per_batch needs max_frames_per_video (the model's)")
        return self


class Spec(_Strict):
    """A vLLM MRV2 deployment, as far as CUDA-graph capture is concerned."""

    target: Target = Field(default_factory=Target, description="Runner and vLLM semantics.")
    scheduler: Scheduler = Field(default_factory=Scheduler, description="Scheduler limits.")
    cudagraph: Cudagraph = Field(default_factory=Cudagraph, description="CUDA-graph settings.")
    lora: Lora = Field(default_factory=Lora, description="LoRA settings.")
    speculative: Speculative = Field(default_factory=Speculative, description="Speculative decoding.")
    parallel: Parallel = Field(default_factory=Parallel, description="Data parallelism.")
    multimodal: Multimodal | None = Field(
        None, description="The model's multimodal encoder (vision tower and connector); null: a text model."
    )
    model: Model | None = Field(
        None,
        description=(
            "The model served (name, architecture, parameters, ...). Optional; when given, estimates from a "
            "calibration of another model are withheld."
        ),
    )
    deployment: Deployment | None = Field(
        None,
        description=(
            "The deployment's own vLLM config (its vllm.yaml and/or serve line): compile reads every setting "
            "they give from there, and the spec leaves those settings out. Absent: the spec is standalone."
        ),
    )
    tiers: Tiers | None = Field(
        None,
        description=(
            "Capture some graphs before the engine reports ready and the rest while it serves "
            "(deferred capture). Absent: every graph before ready, as vLLM does."
        ),
    )
    fixes: list[Fix] = Field(
        default_factory=lambda: list(ALL_FIXES),
        max_length=len(FIX_ORDER),
        description=(
            "capplan's deliberate deviations from vLLM: lora_slot, dummy_remainder, "
            "mixed_ranges, prune_unreachable, and for a multimodal spec with tower LoRA "
            "encoder_lora_eager (in the default where it applies). [] reproduces vLLM exactly."
        ),
    )

    @field_validator("fixes", mode="before")
    @classmethod
    def _fixes_from_str(cls, value: object) -> object:
        if isinstance(value, list):
            out = []
            for item in value:
                if isinstance(item, str):
                    try:
                        item = Fix(item)
                    except ValueError:
                        allowed = ", ".join(f.value for f in FIX_ORDER)
                        raise ValueError(f"unknown fix {item!r}; known: {allowed}") from None
                out.append(item)
            return out
        return value

    @field_validator("fixes")
    @classmethod
    def _canonical_fixes(cls, fixes: list[Fix]) -> list[Fix]:
        if len(set(fixes)) != len(fixes):
            raise ValueError("lists a fix twice; name each fix once")
        return [f for f in FIX_ORDER if f in fixes]

    @model_validator(mode="after")
    def _sizes_fit_budget(self) -> Spec:
        budget = self.scheduler.max_num_batched_tokens
        sizes = self.cudagraph.capture_sizes
        # vLLM drops a given size above the token budget (no batch reaches it) and captures the rest;
        # with none left it has nothing to capture and fails to start: refused here.
        if sizes is not None and sizes[0] > budget:
            raise ValueError(
                f"cudagraph.capture_sizes: every size exceeds scheduler.max_num_batched_tokens ({budget}), "
                "so vLLM would capture none; give a size at most the budget"
            )
        if self.cudagraph.mode is CudagraphMode.NONE and (
            sizes is not None or self.cudagraph.max_capture_size is not None
        ):
            raise ValueError(
                "cudagraph: capture sizes are set but mode is NONE; remove them or choose a capturing mode"
            )
        return self

    @model_validator(mode="after")
    def _case_sizes_need_one_rank(self) -> Spec:
        if self.cudagraph.lora_case_sizes is not None:
            if self.parallel.synced_size > 1:
                raise ValueError(
                    "cudagraph.lora_case_sizes needs data_parallel_size 1: DP ranks with different "
                    "LoRA cases must pad to the same size (failure class 7); remove it"
                )
            if not self.lora.enabled:
                raise ValueError("cudagraph.lora_case_sizes needs lora.enabled; remove it")
        # That each listed case is one of the spec's LoRA capture cases is a planning rule:
        # capplan.loading checks it (capplan.planner.lora_cases), schemas import no planner code.
        return self

    @model_validator(mode="after")
    def _dp_says_moe(self) -> Spec:
        if self.parallel.data_parallel_size > 1 and self.parallel.moe is None:
            raise ValueError(
                "parallel.moe: say whether the model is a mixture of experts (vLLM runs a dense model's DP ranks "
                "as independent engines of data_parallel_size 1; only MoE ranks pad to one another); set "
                "moe: true or moe: false"
            )
        return self

    @model_validator(mode="after")
    def _tiers_where_safe(self) -> Spec:
        if self.tiers is None:
            return self
        refusals = deferred_capture_refusals(self)
        if refusals:
            raise ValueError("tiers: " + "; ".join(f"{why}: {fix}" for why, fix in refusals))
        return self

    @model_validator(mode="after")
    def _multimodal_rules(self) -> Spec:
        mm = self.multimodal
        if mm is None:
            if Fix.encoder_lora_eager in self.fixes:
                raise ValueError("fixes: encoder_lora_eager applies to a multimodal spec only; remove it")
            return self
        if mm.tower_connector_lora and not self.lora.enabled:
            raise ValueError("multimodal.tower_connector_lora needs lora.enabled; enable LoRA or remove it")
        if mm.encoder_cudagraphs and not self.rules.encoder_graphs:
            first = next(v for v, r in RELEASES.items() if r.rules.encoder_graphs)
            raise ValueError(
                f"multimodal.encoder_cudagraphs: vLLM {self.target.vllm}'s Model Runner V2 captures no encoder "
                f'graphs (only its V1 runner does); set it to false, or target.vllm: "{first}" or later'
            )
        if (
            "fixes" not in self.model_fields_set
            and mm.tower_connector_lora
            and Fix.encoder_lora_eager not in self.fixes
        ):
            self.__dict__["fixes"] = [*self.fixes, Fix.encoder_lora_eager]  # the default: every fix that applies
        return self

    def has(self, fix: Fix) -> bool:
        return fix in self.fixes

    @property
    def rules(self) -> Rules:
        """How the target release plans (capplan.releases)."""
        return rules_of(self.target.vllm)

    @property
    def decode_query_len(self) -> int:
        return 1 + self.speculative.num_speculative_tokens


def deferred_capture_refusals(spec: Spec) -> list[tuple[str, str]]:
    """Why the runtime cannot defer captures for this deployment, each reason with its fix
    (none: it can). The one rule for tiers: the spec, `optimize --ready-share` and the
    runtime read it here."""
    out: list[tuple[str, str]] = []
    if spec.parallel.synced_size > 1 and (spec.parallel.pipeline_parallel_size or 1) > 1:
        out.append(
            (
                "deferred capture with DP ranks that pad to one another (an MoE model's) captures at DP-synced "
                "steps, which capplan does not keep in lockstep across pipeline stages",
                "remove tiers, or set pipeline_parallel_size 1",
            )
        )
    if spec.speculative.num_speculative_tokens:
        out.append(
            (
                "deferred capture does not support speculative decoding (vLLM captures the drafter's graphs "
                "together with the model's)",
                "remove tiers or num_speculative_tokens",
            )
        )
    if spec.cudagraph.mode is CudagraphMode.NONE:
        out.append(("cudagraph mode NONE captures no graphs", "remove tiers"))
    return out
