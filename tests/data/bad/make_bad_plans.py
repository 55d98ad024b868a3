"""Writes the malformed plans of this corpus from one valid plan (run from the repo root:
`python tests/data/bad/make_bad_plans.py`). Each file starts with `# expect: <fragment>`."""

from pathlib import Path

from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.planner.render import render_plan

HERE = Path(__file__).resolve().parent
SPEC = {"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
        "lora": {"enabled": True, "max_loras": 2, "specialize_active": True}}
GOOD = render_plan(compile_plan(spec_from_data(SPEC, "bad")), "capplan compile bad.yaml")


def sub(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


def drop_line(prefix: str) -> str:
    lines = GOOD.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    return "".join(lines[:i] + lines[i + 1:])


CASES = {
    "newer-format": (sub("format_version: 1", "format_version: 2"), "format_version: 2 is newer than this capplan reads (1) (upgrade capplan)"),
    "format-string": (sub("format_version: 1", "format_version: one"), "format_version: must be an integer (got 'one')"),
    "format-zero": (sub("format_version: 1", "format_version: 0"), "format_version: must be 1 (got 0)"),
    "spec-hash": (sub("spec_hash: \"sha256:", "spec_hash: \"sha256:0"), "spec_hash does not match the embedded spec"),
    "spec-edited": (sub("max_loras: 2,", "max_loras: 3,"), "spec_hash does not match the embedded spec"),
    "graph-dropped": (drop_line("  - {id: 3,"), "graphs does not match what its spec compiles to"),
    "kernel-grid": (sub("kernel_grid: 3}", "kernel_grid: 2}"), "graphs does not match what its spec compiles to"),
    "lora-map": (sub("lora_dispatch_map: {1: 1, 2: 2, 3: 3}", "lora_dispatch_map: {1: 1, 2: 3, 3: 3}"), "lora_dispatch_map does not match"),
    "dispatch-candidates": (sub("candidates: [", "candidates: [0, "), "dispatch does not match"),
    "fixes": (sub("\nfixes: [lora_slot, dummy_remainder, mixed_ranges, prune_unreachable]", "\nfixes: [lora_slot]"), "fixes does not match"),
    "deviation-text": (sub("no change: vLLM 0.31+ already spreads the remainder", "nothing"), "deviations does not match"),
    "stats": (sub("graphs: 22}", "graphs: 23}"), "stats does not match"),
    "extra-key": (GOOD + "notes: hello\n", "notes: unknown key"),
    "missing-stats": (GOOD.split("stats:")[0] + "graphs:" + GOOD.split("\ngraphs:")[1], "stats: is required"),
    "bad-cg-mode": (sub("cg_mode: PIECEWISE", "cg_mode: HALF"), "graphs.0.descriptor.cg_mode: must be \"NONE\", \"PIECEWISE\" or \"FULL\""),
    "negative-tokens": (sub("num_tokens: 8,", "num_tokens: -8,"), "graphs.0.descriptor.num_tokens: must be >= 0 (got -8)"),
    "dispatch-key": (sub("lora_dispatch_key: kernel_slots", "lora_dispatch_key: slots"), "lora_dispatch_key: must be \"adapters\" or \"kernel_slots\""),
    "duplicate-key": (GOOD.replace("format_version: 1\n", "format_version: 1\nformat_version: 1\n", 1), "duplicate key 'format_version'"),
    "python-tag": (sub("format_version: 1", "format_version: !!python/object/apply:os.system ['true']"), "could not determine a constructor"),
    "truncated": (GOOD[: len(GOOD) // 2].rsplit("\n", 1)[0] + "\n  - {id: 9, descrip", "did not find expected ',' or '}'"),
    "empty": ("", "a plan must be a YAML mapping (got NoneType)"),
    "spec-not-plan": ("lora: {enabled: true}\n", "format_version: is required"),
}

if __name__ == "__main__":
    for old in HERE.glob("plan-*.plan.yaml"):
        old.unlink()
    for name, (text, expect) in CASES.items():
        (HERE / f"plan-{name}.plan.yaml").write_text(f"# expect: {expect}\n{text}")
    print(f"wrote {len(CASES)} bad plans")
