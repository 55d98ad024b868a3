"""The capture plan: everything MRV2 derives at startup, made explicit.

Field names of `Descriptor` are vLLM's `BatchExecutionDescriptor` names. The
plan is validated on load; `capplan.planner.plan_io` renders and reads it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field

from capplan.schemas.spec import Spec

FORMAT_VERSION = 2

CgMode = Literal["NONE", "PIECEWISE", "FULL"]
_new = object.__new__
# pydantic keeps the instance dict and three bookkeeping values in slots:
# set them through the slot descriptors.
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def _trusted_factory(cls: type[_Frozen]) -> staticmethod[..., Any]:
    # Every field is given, so the fields-set is the same for all instances;
    # pydantic only reads it (exclude_unset), so one shared set suffices.
    fields = set(cls.model_fields)

    def trusted(**values: object) -> _Frozen:
        obj = _new(cls)
        _set_dict(obj, values)
        _set_fields(obj, fields)
        _set_extra(obj, None)
        _set_private(obj, None)
        return obj

    trusted.__doc__ = _Frozen.trusted.__doc__
    return staticmethod(trusted)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # A closure per class: no per-call class lookups (compile builds ~1,700).
        setattr(cls, "trusted", _trusted_factory(cls))  # noqa: B010 - replaces the classmethod below

    @classmethod
    def trusted(cls, **values: object) -> Self:
        """Build from values the planner derived itself, skipping validation.

        `model_construct` costs ~8 us per object; a plan has thousands, and
        compile must stay cheaper than vLLM's own startup. Every field must be
        given. Plans read from disk are always fully validated.
        """
        raise NotImplementedError  # replaced per subclass


class Descriptor(_Frozen):
    """vLLM's BatchExecutionDescriptor: the key a CUDA graph is captured and replayed under."""

    cg_mode: CgMode
    num_tokens: int = Field(ge=0)
    num_reqs: int | None = Field(description="None: no request padding (PIECEWISE).")
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = Field(0, ge=0)


class Addressed(Protocol):
    """What names a graph: a Descriptor, or a dispatch result with the same fields."""

    @property
    def cg_mode(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_reqs(self) -> int | None: ...
    @property
    def num_active_loras(self) -> int: ...


def address(desc: Addressed) -> str:
    """A graph's stable name in plan files and messages: `MODE:TOKENS[xREQUESTS]@LORA_CASE`
    (`FULL:64x64@4`, `PIECEWISE:512@0`; requests only where the graph pads them).
    `desc` is a Descriptor or anything with its fields (a dispatch result)."""
    reqs = "" if desc.num_reqs is None else f"x{desc.num_reqs}"
    return f"{desc.cg_mode}:{desc.num_tokens}{reqs}@{desc.num_active_loras}"


class DummyLayout(_Frozen):
    """The dummy batch that warms up and captures one descriptor."""

    num_reqs: int = Field(ge=1)
    tokens: list[tuple[int, int]] = Field(description="Runs of [requests, tokens each], in request order.")
    max_query_len: int = Field(ge=1, description="Longest dummy request, in tokens.")
    lora_ids: list[int] | None = Field(
        description=(
            "Adapter ids cycled over the dummy requests (request i gets "
            "lora_ids[i % len]); -1 is the no-adapter slot. None: LoRA off."
        )
    )
    kernel_grid: int | None = Field(
        description=(
            "Adapter slots the LoRA kernels' grid covers in the captured graph "
            "(0: kernels not recorded). None: LoRA off."
        )
    )


class PlannedGraph(_Frozen):
    """One graph to capture: its descriptor and its dummy layout."""

    id: int = Field(ge=0, description="Position in capture order.")
    descriptor: Descriptor
    dummy: DummyLayout


class DispatchRange(_Frozen):
    """Batches of `lo..hi` tokens with LoRA case `lora_case` try `candidates` in order."""

    lora_case: int = Field(ge=0)
    lo: int = Field(ge=1)
    hi: int = Field(ge=1)
    candidates: list[int] = Field(description="Graph ids, highest priority first.")


class Deviation(_Frozen):
    """A capplan fix and what it changed against vLLM for this spec."""

    fix: str
    failure_class: str
    changes: list[str]


class DummyRun(_Frozen):
    """A dummy batch vLLM runs outside capture (memory profiling, warm-up, a DP rank's idle step)."""

    run: Literal["profile", "dp_idle"]
    tokens: int = Field(ge=1)
    vllm: list[tuple[int, int]] = Field(description="vLLM's runs of [requests, tokens each].")
    plan: list[tuple[int, int]] = Field(description="The runs with the plan in force.")

    @property
    def longest(self) -> int:
        return max(t for _, t in self.plan)

    @property
    def vllm_longest(self) -> int:
        return max(t for _, t in self.vllm)


class DPPolicy(_Frozen):
    """How data-parallel ranks agree on a graph."""

    data_parallel_size: int = Field(ge=1)
    sync: str
    lora_agreement: Literal["local"]
    padded_tokens_lora_invariant: bool


class EncoderPlan(_Frozen):
    """The multimodal encoder: its CUDA graphs (MRV2 from vLLM 0.28) and where its LoRA
    mappings are set."""

    budgets: list[int] = Field(description="Token budgets captured, in capture order (largest first); [] eager.")
    max_items: int = Field(ge=0, description="Most encoder items (images, videos) one graph takes (vLLM's).")
    max_frames: int = Field(ge=0, description="Most video frames one graph takes (vLLM's).")
    vllm_budgets: list[int] = Field(description="What vLLM alone would capture, in capture order.")
    lora: str | None = Field(description="Where the tower and connector LoRA mappings are set; None: no tower LoRA.")


class TierPlan(_Frozen):
    """Deferred capture: the graphs captured while the engine serves, and what a batch whose
    graph is not captured yet replays meanwhile."""

    deferred: list[int] = Field(description="Graph ids captured while serving, in the order they are captured.")
    fallback: dict[int, int] = Field(
        description=(
            "Per deferred graph: the graph its batches replay until it is captured (the next larger of its "
            "mode, decode shape and LoRA case; itself deferred, followed on until a captured one)."
        )
    )
    every_steps: int = Field(ge=1, description="While serving: one deferred capture before every Nth step.")


class Plan(_Frozen):
    """A serialized capture plan."""

    format_version: int
    spec_hash: str
    target: dict[str, str]
    fingerprint: str
    spec: Spec
    fixes: list[str]
    deviations: list[Deviation]
    decode_query_len: int = Field(ge=1)
    capture_sizes: list[int]
    max_capture_size: int = Field(ge=0)
    lora_capture_cases: list[int]
    lora_dispatch_key: Literal["adapters", "kernel_slots"]
    lora_dispatch_map: dict[int, int]
    graphs: list[PlannedGraph]
    dispatch: list[DispatchRange]
    dummy_runs: list[DummyRun]
    dp: DPPolicy
    stats: dict[str, dict[str, int]]
    encoder: EncoderPlan | None = None
    tiers: TierPlan | None = None

    @property
    def descriptors(self) -> list[Descriptor]:
        return [g.descriptor for g in self.graphs]
