"""A small cost model: capture seconds and graph memory from graph counts.

Coefficients are fitted from measured runs in a calibration file (default:
`src/capplan/data/h200-vllm025.yaml`, measured on the H200 with vLLM 0.25.0), so
"max_loras 4 -> 8 adds N graphs, ~X s, ~Y GiB" is known before a GPU boots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from capplan.errors import InputError
from capplan.schemas.plan import Plan

DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "data" / "h200-vllm025.yaml"


class CalibrationRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    no_lora_graphs: int = Field(ge=0)
    lora_graphs: int = Field(ge=0)
    capture_seconds: float = Field(ge=0)
    graph_memory_gib: float = Field(ge=0)


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    runs: list[CalibrationRun] = Field(min_length=3)


@dataclass(frozen=True)
class Coefficients:
    per_graph: float
    per_lora_graph: float
    lora_fixed: float


@dataclass(frozen=True)
class CostModel:
    name: str
    seconds: Coefficients
    gib: Coefficients

    def estimate(self, plan: Plan) -> Estimate:
        lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
        plain = len(plan.graphs) - lora

        def apply(c: Coefficients) -> float:
            return c.per_graph * plain + c.per_lora_graph * lora + (c.lora_fixed if lora else 0.0)

        return Estimate(len(plan.graphs), apply(self.seconds), apply(self.gib))


@dataclass(frozen=True)
class Estimate:
    graphs: int
    capture_seconds: float
    graph_memory_gib: float

    def text(self) -> str:
        return f"{self.graphs} graphs, ~{self.capture_seconds:.0f} s capture, ~{self.graph_memory_gib:.2f} GiB"


def _least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """Solve the 3-unknown normal equations (exact when rows are exactly 3)."""
    n = 3
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * v for r, v in zip(rows, values)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(ata[k][col]))
        if abs(ata[pivot][col]) < 1e-12:
            raise InputError(
                "calibration runs do not determine the model: give runs without LoRA, "
                "with one LoRA case and with several"
            )
        ata[col], ata[pivot] = ata[pivot], ata[col]
        atb[col], atb[pivot] = atb[pivot], atb[col]
        for k in range(n):
            if k != col:
                f = ata[k][col] / ata[col][col]
                ata[k] = [a - f * b for a, b in zip(ata[k], ata[col])]
                atb[k] -= f * atb[col]
    return [atb[i] / ata[i][i] for i in range(n)]


def fit_cost_model(cal: Calibration) -> CostModel:
    """The cost model fitted (least squares) to a calibration's measured runs."""
    rows = [[r.no_lora_graphs, r.lora_graphs, 1.0 if r.lora_graphs else 0.0] for r in cal.runs]
    secs = _least_squares(rows, [r.capture_seconds for r in cal.runs])
    gib = _least_squares(rows, [r.graph_memory_gib for r in cal.runs])
    return CostModel(cal.name, Coefficients(*secs), Coefficients(*gib))
