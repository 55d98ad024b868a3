"""The end-of-run report as the runtime prints it on stderr, from its JSON form."""

from __future__ import annotations

from typing import Any


def render_report(data: dict[str, Any]) -> str:
    """Graphs planned and captured per mode and LoRA case, dispatch counts, DP and trace lines."""
    lines = [f"capplan: plan {data['plan']} ({data['fingerprint'][:19]})"]
    for row in data["graphs"]:
        lines.append(
            f"  {row['cg_mode']:<9} case {row['lora_case']:<3} planned {row['planned']:>4}  "
            f"captured {row['captured']:>4}"
        )
    lines.append(
        f"  graphs: {data['graphs_captured']}/{data['graphs_planned']} captured "
        f"(vLLM alone would capture {data['vllm_would_capture']}), "
        f"{data['capture_seconds']:.1f} s, graph memory {data['graph_memory_gib']} GiB"
    )
    prof = data.get("profiling_capture")
    if prof is not None:
        modes = ", ".join(f"{n} {m}" for m, n in prof["by_mode"].items()) or "none"
        lines.append(
            f"  vLLM's memory profiling first captured {prof['graphs']} of the plan's graphs ({modes}; "
            f"{prof['seconds']:.1f} s) and discarded them; not counted above"
        )
    d = data["dispatch"]
    lines.append(f"  dispatch: {d['calls']} calls, {d['graph_hits']} graph replays, {d['eager']} eager")
    if data["dp"] is not None:
        lines.append(dp_line(data["dp"]))
    deferred = data.get("deferred")
    if deferred is not None:
        lines.append(deferred_line(deferred))
    t = data["trace"]
    if t is not None:
        lines.append(
            f"  trace: {t['steps']} steps to {t['path']} ({t['overhead_us_per_step']} us per step to record"
            + (f"; {t['stopped']}" if t["stopped"] else "")
            + ")"
        )
    return "\n".join(lines)


def dp_line(dp: dict[str, Any]) -> str:
    """What DP synchronisation did to one rank's steps."""
    line = (
        f"  DP rank {dp['rank']}/{dp['size']}: {dp['steps']} steps, {dp['padded_to_other_rank']} padded to another "
        f"rank's size (+{dp['extra_tokens_from_other_ranks']} tokens), {dp['eager_together']} eager together "
        f"({dp['forced_eager']} forced by another rank), {dp['idle_steps']} idle"
    )
    if dp["audited_steps"]:
        line += f"; audit: {dp['token_disagreements']} of {dp['audited_steps']} steps with differing padded sizes"
    return line


def deferred_line(d: dict[str, Any]) -> str:
    """What deferred capture did: graphs captured while serving, the pauses, the fallbacks."""
    line = (
        f"  deferred: {d['captured']}/{d['deferred']} captured while serving ({d['capture_seconds']:.2f} s; "
        f"longest step pause {d['longest_step_pause_seconds'] * 1000:.0f} ms, longest idle capture "
        f"{d['longest_idle_capture_seconds'] * 1000:.0f} ms), {d['fallback_steps']} steps on a fallback, "
        f"graph memory {d['graph_memory_gib']} GiB (held back {d['reserved_gib']} GiB)"
    )
    if d.get("reserve_shortfall"):
        line += "; a capture took more than its share, and less memory could be held back after it"
    if d["pending"]:
        line += f"; still pending: {len(d['pending'])}"
    return line
