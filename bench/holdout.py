"""optimize on traffic it did not fit: the example traces, regenerated for two deployments.

    python -m bench.holdout            # prints a markdown table; writes bench/holdout-last-run.txt

For the README's deployment (configs/qwen3-8b-multilora.yaml) and an 8B
deployment (max_num_seqs 64, max_num_batched_tokens 8192, max_model_len
8192, LoRA with max_loras 4), the three example traces are regenerated for
its limits (examples/traces/make_traces.py) and `capplan optimize` runs as
the command does: fitted on the first 80% of each trace, judged on the last
20% against the spec's own sizes, under a budget of 60% of the default
plan's graphs. Each row: the default's graphs and held-out padding, what
optimize wrote (the fitted set, or the spec's own sizes and why), and
whether the target holds: the written set's held-out padding no worse than
the default's with fewer graphs, or the default kept with the reason.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = {
    "README (qwen3-8b-multilora)": (ROOT / "configs" / "qwen3-8b-multilora.yaml").read_text(),
    "8B, max_num_seqs 64, max_loras 4": (
        "# The 8B deployment: Llama-3.1-8B-Instruct served with 4 LoRA adapters.\n"
        'target: {runner: mrv2, vllm: "0.33"}\n'
        "scheduler: {max_num_seqs: 64, max_num_batched_tokens: 8192, max_model_len: 8192}\n"
        "lora: {enabled: true, max_loras: 4}\n"
    ),
}


def _make_traces():
    path = ROOT / "examples" / "traces" / "make_traces.py"
    spec = importlib.util.spec_from_file_location("bench_make_traces", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_make_traces"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from capplan.commands.traffic import OptimizeRequest, optimize
    from capplan.loading import load_spec
    from capplan.planner import compile_plan

    make = _make_traces()
    lines = [
        "| deployment | trace | default graphs | written | held-out padding: best fitted vs default | eager steps | target |",
        "|---|---|---:|---|---|---|---|",
    ]
    ok_all = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in DEPLOYMENTS.items():
            spec_path = Path(tmp) / f"{len(lines)}.yaml"
            spec_path.write_text(text)
            limits = make.limits_from_spec(spec_path)
            default_graphs = len(compile_plan(load_spec(spec_path)).graphs)
            budget = int(0.6 * default_graphs)
            for trace_name, fn, seed in make.TRACES:
                trace = Path(tmp) / f"{trace_name}-{limits.seqs}.jsonl"
                trace.write_text(make.render(trace_name, fn(random.Random(seed), limits), limits))
                start = time.perf_counter()
                out = optimize(OptimizeRequest(spec_path, [trace], max_graphs=budget, output=Path(tmp) / "o.yaml"))
                seconds = time.perf_counter() - start
                h, result = out.held_out, out.result
                assert h is not None and result is not None
                if out.kept_default is not None:
                    written = f"spec's own sizes ({default_graphs} graphs): best in {budget} pads more held out"
                    target = "default kept, with the reason"
                    ok = True
                else:
                    graphs = len(result.plan.graphs)
                    written = f"{result.point.sizes} sizes, {graphs} graphs"
                    ok = graphs < default_graphs and h.padding <= h.default_padding and h.eager <= h.default_eager
                    target = "met" if ok else "MISSED"
                ok_all &= ok
                lines.append(
                    f"| {name} | {trace_name} | {default_graphs} | {written} | {h.padding:.2%} vs "
                    f"{h.default_padding:.2%} | {h.eager} vs {h.default_eager} | {target} ({seconds:.0f} s) |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
    lines.append(
        "budget: 60% of the default plan's graphs; fitted on the first 80% of each trace, held out the last 20%"
    )
    text = "\n".join(lines)
    print(text)
    (ROOT / "bench" / "holdout-last-run.txt").write_text(text + "\n")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
