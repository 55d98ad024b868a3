"""What `capplan simulate` prints: hit rate, eager steps, padding, unused graphs and the
predicted step time, from the simulation's JSON form."""

from __future__ import annotations

from capplan.calibration.price import Priced
from capplan.schemas.plan import Plan
from capplan.traffic.simulate import Simulation


def render_simulation(
    plan_name: str, trace_name: str, plan: Plan, sim: Simulation, priced: Priced | None = None
) -> str:
    data = sim.to_json(plan)
    lines = [
        f"capplan simulate {plan_name} {trace_name}: {data['steps']} steps"
        + (f" over {len(sim.ranks)} DP ranks ({sim.dp_steps} DP steps)" if len(sim.ranks) > 1 else ""),
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
    if priced is not None:
        how = f"{priced.kind}; {priced.basis}" if priced.priced else priced.basis
        lines.append(f"  capture: {priced.text()} ({how})")
        lines += [f"    {n}" for n in priced.notes]
    for r in data.get("ranks", []):
        lines.append(
            f"  rank {r['rank']}: {r['steps']} steps, {r['graph_steps']} graph, {r['eager_steps']} eager, "
            f"{r['idle_steps']} idle (dummy batch), padding {r['padding_overhead']:.2%}"
        )
    if data["predicted_step_seconds"] is not None:
        lo, hi = data["predicted_step_seconds_bounds"]
        lines.append(
            f"  predicted step time {data['predicted_step_seconds']:.2f} s over the trace (between {lo:.2f} and "
            f"{hi:.2f} s; {sim.step_model})"
        )
    elif sim.unpriced_points():
        missing = sim.unpriced_points()
        shown = ", ".join(f"{p.text()} ({n} steps)" for p, n in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        lines.append(
            f"  step time not predicted: {len(missing)} point(s) the calibration did not measure: {shown}{more}"
        )
    elif sim.step_model:
        lines.append(f"  {sim.step_model}")
    if sim.assumption:
        lines.append(f"  note: {sim.assumption}")
    lines.append("  size  steps  padded tokens")
    for row in data["by_size"]:
        lines.append(f"  {row['num_tokens']:>4}  {row['steps']:>5}  {row['padded_tokens']:>13}")
    return "\n".join(lines)
