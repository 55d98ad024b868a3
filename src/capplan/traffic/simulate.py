"""The simulator: replay a batch trace through a plan's dispatcher (reading traces: capplan.batches)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from capplan.planner.dispatch import Batch, Dispatcher
from capplan.schemas.plan import Plan
from capplan.traffic.cost import CostModel


@dataclass(frozen=True)
class TraceBatch:
    batch: Batch
    count: int


@dataclass
class SimResult:
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    real_tokens: int = 0  # tokens of batches that replayed a graph
    padded_tokens: int = 0  # tokens added by padding on those batches
    eager_tokens: int = 0
    eager_above_largest: int = 0  # eager because more tokens than the largest graph
    hits: Counter = field(default_factory=Counter)  # graph id -> steps
    by_size: dict = field(default_factory=dict)  # num_tokens -> [steps, padded tokens]
    unused: list = field(default_factory=list)  # graph ids never replayed
    step_ms: float | None = None  # predicted total step time (a calibration with step times)
    step_model: str | None = None  # the calibration that predicted it

    @property
    def hit_rate(self) -> float:
        return self.graph_steps / self.steps if self.steps else 0.0

    @property
    def padding_overhead(self) -> float:
        """Padded tokens per real token, over batches that replayed a graph."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    def to_json(self, plan: Plan) -> dict:
        unused = Counter(
            (plan.graphs[i].descriptor.cg_mode, plan.graphs[i].descriptor.num_active_loras) for i in self.unused
        )
        return {
            "steps": self.steps,
            "graph_steps": self.graph_steps,
            "eager_steps": self.eager_steps,
            "graph_hit_rate": round(self.hit_rate, 6),
            "eager_above_largest_graph": self.eager_above_largest,
            "real_tokens_in_graphs": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_overhead": round(self.padding_overhead, 6),
            "eager_tokens": self.eager_tokens,
            "predicted_step_seconds": None if self.step_ms is None else round(self.step_ms / 1000, 6),
            "step_model": self.step_model,
            "graphs": len(plan.graphs),
            "graphs_used": len(plan.graphs) - len(self.unused),
            "graphs_never_used": len(self.unused),
            "never_used_by_mode_and_case": [
                {"cg_mode": m, "lora_case": c, "graphs": n} for (m, c), n in sorted(unused.items())
            ],
            "by_size": [
                {"num_tokens": s, "steps": v[0], "padded_tokens": v[1]} for s, v in sorted(self.by_size.items())
            ],
        }


def simulate(
    plan: Plan, trace: list[TraceBatch], dispatcher: Dispatcher | None = None, cost: CostModel | None = None
) -> SimResult:
    """Replay the trace; with a cost model that has step times, also predict the total step time."""
    dispatcher = dispatcher or Dispatcher(plan)
    result = SimResult()
    steps = cost.steps if cost is not None else None
    if steps is not None:
        result.step_ms, result.step_model = 0.0, cost.name
    largest = plan.max_capture_size
    for item in trace:
        batch, n = item.batch, item.count
        d = dispatcher.dispatch(batch)
        result.steps += n
        if steps is not None:
            if d.graph_id < 0:
                result.step_ms += n * steps.ms("eager", d.num_active_loras, batch.num_tokens)
            else:
                mode = "graph" if d.cg_mode == "FULL" else "piecewise"
                result.step_ms += n * steps.ms(mode, d.num_active_loras, d.num_tokens)
        if d.graph_id < 0:
            result.eager_steps += n
            result.eager_tokens += n * batch.num_tokens
            result.eager_above_largest += n * (batch.num_tokens > largest)
            continue
        pad = d.num_tokens - batch.num_tokens
        result.graph_steps += n
        result.real_tokens += n * batch.num_tokens
        result.padded_tokens += n * pad
        result.hits[d.graph_id] += n
        row = result.by_size.setdefault(d.num_tokens, [0, 0])
        row[0] += n
        row[1] += n * pad
    result.unused = [i for i in range(len(plan.graphs)) if i not in result.hits]
    return result


def render_simulation(plan_name: str, trace_name: str, plan: Plan, result: SimResult) -> str:
    data = result.to_json(plan)
    lines = [
        f"capplan simulate {plan_name} {trace_name}: {data['steps']} steps",
        f"  graph hit rate {data['graph_hit_rate']:.1%} ({data['graph_steps']} steps replayed a graph, "
        f"{data['eager_steps']} eager, {data['eager_above_largest_graph']} of them above the largest graph "
        f"of {plan.max_capture_size} tokens)",
        f"  padding overhead {data['padding_overhead']:.2%} ({data['padded_tokens']} padded tokens on "
        f"{data['real_tokens_in_graphs']} real tokens in graphs)",
        f"  graphs used {data['graphs_used']} of {data['graphs']}; never used: {data['graphs_never_used']}"
        + (
            ""
            if not data["never_used_by_mode_and_case"]
            else " ("
            + ", ".join(
                f"{u['cg_mode']} case {u['lora_case']}: {u['graphs']}" for u in data["never_used_by_mode_and_case"]
            )
            + ")"
        ),
    ]
    if data["predicted_step_seconds"] is not None:
        lines.append(
            f"  predicted step time {data['predicted_step_seconds']:.2f} s over the trace "
            f"(step model {data['step_model']})"
        )
    lines.append("  size  steps  padded tokens")
    for row in data["by_size"]:
        lines.append(f"  {row['num_tokens']:>4}  {row['steps']:>5}  {row['padded_tokens']:>13}")
    return "\n".join(lines)
