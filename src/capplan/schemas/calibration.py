"""The calibration file: starts, probes, capture runs and step times measured on one deployment.

`capplan calibrate`, `calibrate-start`, `calibrate-steps` and `calibrate-trace` write it; `show`,
`diff`, `flags`, `simulate` and `optimize` read it with `--calibration` (`capplan/loading.py` loads
it; `capplan/calibration/price.py` prices capture from it, `capplan/traffic/steps.py` reads its
step times). Validation only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from capplan.schemas.spec import PRINTABLE, Model


class _Strict(BaseModel):
    # Finite numbers only, no booleans or strings for numbers: a calibration is measured data.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CalibrationRun(_Strict):
    label: str = Field(max_length=500, pattern=PRINTABLE)
    no_lora_graphs: int = Field(ge=0, le=10_000_000)
    lora_graphs: int = Field(ge=0, le=10_000_000)
    max_tokens: int = Field(ge=1, le=1 << 24)  # the largest graph's tokens: its workspace stays in the graph pool
    capture_seconds: float = Field(ge=0, le=86_400)  # a day: no capture of one engine takes longer
    graph_memory_gib: float = Field(ge=0, le=1024)  # one process's graphs: more than any GPU holds


class StepTime(_Strict):
    mode: Literal["graph", "piecewise", "eager"]
    case: int = Field(ge=0, le=1 << 16)
    tokens: int = Field(ge=1, le=1 << 24)
    ms: float = Field(gt=0, le=1e6)  # a step of over 1000 s is no measurement


class ModelShape(_Strict):
    """The model's shape, as its config.json gives it: what a captured graph's launches and
    workspace follow (capplan.calibration.shape reads it)."""

    num_layers: int = Field(ge=1, le=1 << 16)
    hidden_size: int = Field(ge=1, le=1 << 24)
    intermediate_size: int | None = Field(None, ge=1, le=1 << 26)
    num_attention_heads: int | None = Field(None, ge=1, le=1 << 16)
    num_key_value_heads: int | None = Field(None, ge=1, le=1 << 16)
    vocab_size: int | None = Field(None, ge=1, le=1 << 26)
    num_experts: int | None = Field(None, ge=1, le=1 << 16)
    dtype: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)


IdentityField = Literal[
    "model", "shape", "gpu", "vllm", "torch", "attention_backend", "tensor_parallel_size",
    "pipeline_parallel_size", "data_parallel_size", "lora_rank",
]  # fmt: skip


class Identity(_Strict):
    """What a calibration was measured on. `given`: the fields the operator gave when the
    calibration was made (a start report of an older runtime does not record them), as
    opposed to the ones measured."""

    model: Model | None = None
    gpu: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE)
    vllm: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    torch: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    tensor_parallel_size: int | None = Field(None, ge=1, le=1024)
    pipeline_parallel_size: int | None = Field(None, ge=1, le=1024)
    shape: ModelShape | None = None
    attention_backend: str | None = Field(None, min_length=1, max_length=100, pattern=PRINTABLE)
    data_parallel_size: int | None = Field(None, ge=1, le=1024)
    lora_rank: int | None = Field(None, ge=1, le=1 << 16)
    given: list[IdentityField] = Field(default_factory=list, max_length=20)


class CaptureCost(_Strict):
    """One graph's capture as a probe read it (`capplan calibrate`): its seconds and the growth
    across it (a graph pool's only where the report's format is 2: see `Start.plan_memory`)."""

    cg_mode: Literal["FULL", "PIECEWISE"]
    lora_case: int = Field(ge=0, le=1 << 16)
    num_tokens: int = Field(ge=1, le=1 << 24)
    seconds: float = Field(ge=0, le=86_400)
    mib: float = Field(ge=-(1 << 20), le=1 << 20)  # a growth: a capture may free more than it takes


class GraphSizes(_Strict):
    """A plan's graphs of one mode and LoRA case: their token sizes."""

    cg_mode: Literal["FULL", "PIECEWISE"]
    lora_case: int = Field(ge=0, le=1 << 16)
    sizes: list[int] = Field(min_length=1, max_length=1 << 16)


class Start(_Strict):
    """One engine start under `capplan apply`, from the report it left (CAPPLAN_REPORT): the
    plan it captured (its fingerprint, graph counts and largest graph) and what capture took."""

    report: str = Field(min_length=1, max_length=1000, pattern=PRINTABLE)  # the report file, as given
    fingerprint: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    graphs: int = Field(ge=1, le=10_000_000)
    lora_graphs: int = Field(ge=0, le=10_000_000)
    max_tokens: int = Field(ge=1, le=1 << 24)
    capture_seconds: float = Field(gt=0, le=86_400)  # a day: no capture of one engine takes longer
    graph_memory_gib: float = Field(gt=0, le=1024)  # one process's graphs: more than any GPU holds
    after_profiling: bool | None = None
    """Whether the capture followed vLLM's memory-profiling capture (0.29.0 on, unless the KV cache's
    size is given): that first capture leaves memory allocated that the second reuses, so the
    second's graph memory leaves it out (8B on an H100: 0.35 GiB after the pass, 1.19 GiB without
    it). None: the report did not say (written by an older runtime)."""
    report_format: int | None = Field(None, ge=0, le=1 << 16)  # of the report it was read from
    graph_sizes: list[GraphSizes] = Field(default_factory=list, max_length=1 << 16)  # the plan's graphs
    captures: list[CaptureCost] = Field(default_factory=list, max_length=1 << 20)  # each graph's, in order
    vllm_estimate_gib: float | None = Field(None, ge=0, le=1024)  # vLLM's estimate from its profiling pass
    profiling_seconds: float | None = Field(None, ge=0, le=86_400)  # vLLM's profiling capture, where it ran
    kv_cache_tokens: int | None = Field(None, ge=1, le=1 << 40)  # the KV cache vLLM sized
    host_cpu: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE)
    host_cores: int | None = Field(None, ge=1, le=1 << 16)

    @property
    def plan_memory(self) -> bool:
        """Whether `graph_memory_gib` is the plan's graph memory: not where each graph was captured
        in a vLLM call of its own (captures in a report below format 2), whose pool no graph shares
        with another."""
        return not (self.captures and (self.report_format or 0) < 2)


class Calibration(_Strict):
    name: str = Field(min_length=1, max_length=200, pattern=PRINTABLE)
    identity: Identity | None = None
    runs: list[CalibrationRun] = Field(default_factory=list, max_length=10_000)
    step_times: list[StepTime] = Field(default_factory=list, max_length=100_000)
    starts: list[Start] = Field(default_factory=list, max_length=10_000)
