"""The calibration file: capture runs and step times measured on one deployment.

`capplan calibrate` and `calibrate-trace` write it; `show`, `diff`, `simulate`
and `optimize` read it with `--calibration` (`capplan/loading.py` loads it,
`capplan/traffic/cost.py` fits the cost model to it). Validation only.
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
    capture_seconds: float = Field(ge=0, le=1e6)
    graph_memory_gib: float = Field(ge=0, le=1e5)


class StepTime(_Strict):
    mode: Literal["graph", "piecewise", "eager"]
    case: int = Field(ge=0, le=1 << 16)
    tokens: int = Field(ge=1, le=1 << 24)
    ms: float = Field(gt=0, le=1e6)  # a step of over 1000 s is no measurement


class Identity(_Strict):
    """What a calibration was measured on."""

    model: Model | None = None
    gpu: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE)
    vllm: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    torch: str | None = Field(None, min_length=1, max_length=50, pattern=PRINTABLE)
    tensor_parallel_size: int | None = Field(None, ge=1, le=1024)
    pipeline_parallel_size: int | None = Field(None, ge=1, le=1024)


class Calibration(_Strict):
    name: str = Field(min_length=1, max_length=200, pattern=PRINTABLE)
    identity: Identity | None = None
    runs: list[CalibrationRun] = Field(default_factory=list, max_length=10_000)
    step_times: list[StepTime] = Field(default_factory=list, max_length=100_000)
