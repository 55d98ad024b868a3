"""The start report: what one engine process did with the plan in force (`capplan apply --report`,
CAPPLAN_REPORT), written by `capplan.runtime.report` and read by `capplan calibrate-start` and
`capplan calibrate`. Validation only.

The format is versioned (`report_format`). Reports of runtimes before the version was written
carry none and are read as format 0 (their fields are a subset of format 1's); a report of a
format this capplan does not know is refused with the reason, never read as if it were one it
knows.
- Format 1 adds, to format 0: each capture's seconds and growth (`captures`), vLLM's graph-memory
  estimate from its profiling pass (`vllm_estimate_gib`), the KV cache vLLM sized (`kv_cache`),
  and the host in `identity`. Its `captures` come from one vLLM capture call per graph: their
  seconds are each graph's, but their memory is not a plan's (vLLM captures each call on a new
  stream, so no graph reuses another's freed pool memory: 4.3x the memory at 8B on an H100).
- Format 2: the same keys; `captures` read between one graph and the next of vLLM's one capture
  (one stream, one pool), so that their growths add up to the plan's graph memory.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from capplan.schemas.calibration import ModelShape
from capplan.schemas.spec import PRINTABLE

REPORT_FORMAT = 2
KNOWN_FORMATS = (0, 1, 2)
PER_CALL_CAPTURES = 1  # the format whose captures took a vLLM call each: their memory is no plan's


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GraphCount(_Strict):
    cg_mode: Literal["FULL", "PIECEWISE"]
    lora_case: int = Field(ge=0, le=1 << 16)
    planned: int = Field(ge=0)
    captured: int = Field(ge=0)


class Capture(_Strict):
    """One graph's capture, measured (CAPPLAN_CAPTURE_EACH; format 1: each graph in a vLLM call of its
    own, format 2: between one graph and the next of vLLM's one capture): its seconds (the GPU's
    queued work waited for first) and the pool's growth across it (this process's device memory
    where NVML gives it)."""

    graph: int = Field(ge=0)
    cg_mode: Literal["FULL", "PIECEWISE"]
    num_tokens: int = Field(ge=1, le=1 << 24)
    lora_case: int = Field(ge=0, le=1 << 16)
    seconds: float = Field(ge=0, le=86_400)
    bytes: int = Field(ge=-(1 << 40), le=1 << 40)  # a growth; a capture may free more than it takes


class KVCache(_Strict):
    blocks: int = Field(ge=1)
    block_size: int = Field(ge=1)
    tokens: int = Field(ge=1)


class Dispatch(_Strict):
    calls: int = Field(ge=0)
    graph_hits: int = Field(ge=0)
    eager: int = Field(ge=0)
    hits_by_graph: dict[str, int]


class ProfilingCapture(_Strict):
    graphs: int = Field(ge=0)
    by_mode: dict[str, int]
    seconds: float = Field(ge=0, le=86_400)


class Identity(_Strict):
    """The deployment as the runtime read it from vLLM's config (`runtime.report.identify`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # a newer runtime may say more
    shape: ModelShape | None = None
    model: str | None = Field(None, min_length=1, max_length=500, pattern=PRINTABLE)
    gpu: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE)
    vllm: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    torch: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    attention_backend: str | None = Field(None, min_length=1, max_length=100, pattern=PRINTABLE)
    tensor_parallel_size: int | None = Field(None, ge=1, le=1024)
    pipeline_parallel_size: int | None = Field(None, ge=1, le=1024)
    data_parallel_size: int | None = Field(None, ge=1, le=1024)
    lora_rank: int | None = Field(None, ge=1, le=1 << 16)
    host_cpu: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE)
    host_cores: int | None = Field(None, ge=1, le=1 << 16)


class StartReport(_Strict):
    """A report of format 1 or 2, every key the runtime writes (`Report.to_json`)."""

    capplan_commit: str | None = Field(None, max_length=64)  # added where a GPU run keeps the report
    plan: str
    report_format: Literal[1, 2]
    fingerprint: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    pid: int
    graphs: list[GraphCount]
    graphs_planned: int = Field(ge=0)
    graphs_captured: int = Field(ge=0)
    vllm_would_capture: int | None = Field(ge=0)
    capture_seconds: float = Field(ge=0, le=1e6)
    graph_memory_gib: float | None = Field(ge=-1024, le=1024)
    captures: list[Capture] | None
    vllm_estimate_gib: float | None = Field(ge=0, le=1024)
    kv_cache: KVCache | None
    dispatch: Dispatch
    profiling_capture: ProfilingCapture | None
    dp: dict[str, Any] | None
    trace: dict[str, Any] | None
    deferred: dict[str, Any] | None
    identity: Identity | None
    graph_budget: dict[str, Any] | None
