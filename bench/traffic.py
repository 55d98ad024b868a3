"""Traffic-driven capture sets vs vLLM's default, on the example traces, in one run.

    python -m bench.traffic                 # vLLM's side: real 0.33.0 code on CPU (oracle venv)
    python -m bench.traffic --capplan-only  # vLLM's default set from capplan's planner (fixes: [])

Spec: configs/qwen3-8b-multilora.yaml (the traces' engine shape). For each
trace in examples/traces/:
- vLLM: its default capture set (CudaGraphManager built by vLLM's code),
  every batch of the trace dispatched by vLLM's own `dispatch()`: graphs,
  padded tokens per real token in graphs, eager steps.
- capplan at 60% of vLLM's graph count, and at vLLM's graph count:
  `optimize` on the trace, the compiled plan replayed by capplan's
  dispatcher (`simulate`).
The target: at most 60% of vLLM's graphs at no more padding, or at
most half its padding at the same graph count. Also checks that capplan's
simulator, run on vLLM's exact plan, counts what vLLM's dispatch counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.run import ROOT, add_oracle_option, oracle_module, run_in_oracle_if_needed

SPEC = ROOT / "configs" / "qwen3-8b-multilora.yaml"
TRACES = ROOT / "examples" / "traces"


def vllm_default(spec, trace, vllm_side) -> dict:
    manager = vllm_side.build_manager({**spec.model_dump(mode="json"), "fixes": []}).manager
    derive = vllm_side.uniform_rule()
    graphs = sum(len(v) for v in manager._capture_descs.values())
    steps = eager = real = padded = 0
    for item in trace:
        b, n = item.batch, item.count
        count = b.num_active_loras  # vLLM counts adapters (no slot fix)
        d = manager.dispatch(
            b.num_reqs,
            b.num_tokens,
            derive(b.num_reqs, b.num_tokens, b.max_query_len, b.has_prefill),
            num_active_loras=count,
            max_query_len=None if b.has_prefill else b.max_query_len,
        )
        steps += n
        if d.cg_mode.name == "NONE":
            eager += n
        else:
            real += n * b.num_tokens
            padded += n * (d.num_tokens - b.num_tokens)
    return {"graphs": graphs, "padded_tokens": padded, "padding": padded / real, "eager": eager, "steps": steps}


def capplan_side(plan, trace) -> dict:
    from capplan.traffic.simulate import simulate

    r = simulate(plan, trace)
    return {
        "graphs": len(plan.graphs),
        "padded_tokens": r.padded_tokens,
        "padding": r.padding_overhead,
        "eager": r.eager_steps,
        "steps": r.steps,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.traffic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capplan-only", action="store_true", help="vLLM's default set from capplan (fixes: [])")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "traffic-results.json")
    add_oracle_option(parser)
    args = parser.parse_args(argv)
    code = run_in_oracle_if_needed(args, argv, "bench.traffic")
    if code is not None:
        return code

    from capplan.analysis.verify import verify_plan
    from capplan.batches import read_batches
    from capplan.loading import load_spec, load_steps
    from capplan.planner import compile_plan
    from capplan.traffic.optimize import optimize

    vllm_side = oracle_module(args)
    spec = load_spec(SPEC)
    exact = compile_plan(spec.model_copy(update={"fixes": []}))
    cost = load_steps()
    rows, ok_all = {}, True
    lines = [
        f"spec {SPEC.relative_to(ROOT)}; vLLM side: "
        f"{'capplan planner, fixes: []' if vllm_side is None else 'vLLM ' + vllm_side.VLLM_VERSION}",
        "| trace | vLLM default: graphs, padding, eager | capplan @60% graphs | capplan @same graphs | target |",
        "|---|---|---|---|---|",
    ]
    for path in sorted(TRACES.glob("*.jsonl")):
        trace = read_batches(path, spec).batches
        print(f"[bench.traffic] {path.name}: {sum(t.count for t in trace)} steps", file=sys.stderr, flush=True)
        base = vllm_default(spec, trace, vllm_side) if vllm_side else capplan_side(exact, trace)
        sim_of_exact = capplan_side(exact, trace)
        agree = (sim_of_exact["padded_tokens"], sim_of_exact["eager"], sim_of_exact["graphs"]) == (
            base["padded_tokens"],
            base["eager"],
            base["graphs"],
        )
        small = optimize(spec, trace, cost, max_graphs=int(0.6 * base["graphs"]))
        same = optimize(spec, trace, cost, max_graphs=base["graphs"])
        at60, atsame = capplan_side(small.plan, trace), capplan_side(same.plan, trace)
        verifies = verify_plan(small.plan).ok and verify_plan(same.plan).ok
        met60 = (
            at60["graphs"] <= 0.6 * base["graphs"]
            and at60["padded_tokens"] <= base["padded_tokens"]
            and at60["eager"] <= base["eager"]
        )
        methalf = (
            atsame["graphs"] <= base["graphs"]
            and atsame["padded_tokens"] <= 0.5 * base["padded_tokens"]
            and atsame["eager"] <= base["eager"]
        )
        ok_all &= (met60 or methalf) and agree and verifies
        rows[path.stem] = {
            "vllm_default": base,
            "capplan_sim_of_vllm_plan_agrees": agree,
            "capplan_at_60pct": at60,
            "capplan_at_same": atsame,
            "met_60pct_no_more_padding": met60,
            "met_half_padding_same_graphs": methalf,
            "optimized_plans_verify": verifies,
            "sizes_at_60pct": small.point.capture_sizes,
            "sizes_at_same": same.point.capture_sizes,
        }

        def cell(r):
            return f"{r['graphs']}, {r['padding']:.2%}, {r['eager']}"

        target = " / ".join(x for x, ok in (("60% at <= padding", met60), ("half padding", methalf)) if ok) or "MISSED"
        ratio_same = atsame["padded_tokens"] / base["padded_tokens"] if base["padded_tokens"] else 0.0
        lines.append(
            f"| {path.stem} | {cell(base)} | {cell(at60)} | {cell(atsame)} (padding x{ratio_same:.2f}) | {target} |"
        )
    lines.append("cells: graphs, padded tokens per real token on steps that replayed a graph, eager steps")
    lines.append(
        f"capplan's simulator agrees with the vLLM side on vLLM's exact plan: "
        f"{all(r['capplan_sim_of_vllm_plan_agrees'] for r in rows.values())}; every optimized plan "
        f"verifies: {all(r['optimized_plans_verify'] for r in rows.values())}"
    )
    print("\n".join(lines))
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
