"""Writes the malformed plans of this corpus from one valid plan (run from the repo root:
`python tests/data/bad/make_bad_plans.py`). Each file starts with `# expect: <fragment>`."""

from pathlib import Path

from capplan.loading import spec_from_data
from capplan.planfile import render_plan
from capplan.planner import compile_plan

HERE = Path(__file__).resolve().parent
SPEC = {
    "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
    "lora": {"enabled": True, "max_loras": 2, "specialize_active": True},
}
GOOD = render_plan(compile_plan(spec_from_data(SPEC, "bad")), "bad.yaml")


SIZES = ", ".join(map(str, range(1, 2049)))  # the most capture sizes a spec may list


def sub(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


def drop_line(prefix: str) -> str:
    lines = GOOD.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    return "".join(lines[:i] + lines[i + 1 :])


FORMAT_1 = """format_version: 1
spec_hash: "sha256:0"
graphs:
  - {id: 0, descriptor: {cg_mode: PIECEWISE, num_tokens: 8}}
"""

CASES = {
    "newer-format": (
        sub("format_version: 2", "format_version: 3"),
        "format_version: 3 is newer than this capplan reads (2) (upgrade capplan)",
    ),
    "format-1": (
        FORMAT_1,
        "a format 1 plan; this capplan reads format 2 (run capplan compile SPEC again to rewrite it)",
    ),
    "format-string": (
        sub("format_version: 2", 'format_version: "2"'),
        "format_version: must be the integer 2 (got '2')",
    ),
    "format-float": (
        sub("format_version: 2", "format_version: 2.0"),
        "format_version: must be the integer 2 (got 2.0)",
    ),
    "format-bool": (
        sub("format_version: 2", "format_version: true"),
        "format_version: must be the integer 2 (got True)",
    ),
    "format-zero": (sub("format_version: 2", "format_version: 0"), "a format 0 plan; this capplan reads format 2"),
    "fingerprint": (
        sub('fingerprint: "sha256:', 'fingerprint: "sha256:0'),
        "fingerprint: differs from what its spec compiles to",
    ),
    "spec-edited": (sub("max_loras: 2,", "max_loras: 3,"), "fingerprint: differs from what its spec compiles to"),
    "spec-invalid": (sub("max_loras: 2,", "max_loras: -2,"), "spec.lora.max_loras: must be >= 1 (got -2)"),
    "spec-missing": (
        GOOD.split("spec:")[0] + "deviations:" + GOOD.split("\ndeviations:")[1],
        "spec: must be a mapping of the spec's sections",
    ),
    "graph-dropped": (
        drop_line("  - {graph: PIECEWISE:4@1,"),
        "graphs[5]: the file has graph 'PIECEWISE:4@2' where its spec compiles to 'PIECEWISE:4@1'",
    ),
    "graphs-swapped": (
        sub(
            "  - {graph: PIECEWISE:8@0, dummy: [[4, 2]], grid: 0}\n  - {graph: PIECEWISE:8@1, dummy: [[4, 2]], grid: 1}",
            "  - {graph: PIECEWISE:8@1, dummy: [[4, 2]], grid: 1}\n  - {graph: PIECEWISE:8@0, dummy: [[4, 2]], grid: 0}",
        ),
        "graphs[0]: the file has graph 'PIECEWISE:8@1' where its spec compiles to 'PIECEWISE:8@0'",
    ),
    "graphs-reversed": (
        "\n".join(
            [line for line in GOOD.split("\n") if not line.startswith("  - {graph: ")][
                : GOOD.split("\n").index("graphs:") + 1
            ]
            + [line for line in GOOD.split("\n") if line.startswith("  - {graph: ")][::-1]
            + GOOD.split("\n")[
                max(i for i, line in enumerate(GOOD.split("\n")) if line.startswith("  - {graph: ")) + 1 :
            ]
        ),
        "graphs[0]: the file has graph 'FULL:",
    ),
    "kernel-grid": (
        sub("{graph: PIECEWISE:8@3, dummy: [[4, 2]], grid: 3}", "{graph: PIECEWISE:8@3, dummy: [[4, 2]], grid: 2}"),
        "graphs[3] (PIECEWISE:8@3).grid: the file says 2, its spec compiles to 3",
    ),
    "grid-bool": (
        sub("{graph: PIECEWISE:8@1, dummy: [[4, 2]], grid: 1}", "{graph: PIECEWISE:8@1, dummy: [[4, 2]], grid: true}"),
        "graphs[1] (PIECEWISE:8@1).grid: the file says True, its spec compiles to 1",
    ),
    "dummy-layout": (
        sub("{graph: PIECEWISE:8@0, dummy: [[4, 2]]", "{graph: PIECEWISE:8@0, dummy: [[3, 2], [1, 2]]"),
        "graphs[0] (PIECEWISE:8@0).dummy[0][0]: the file says 3, its spec compiles to 4",
    ),
    "lora-cases": (
        sub("{case: 2, serves: [2], dummy_ids: [1, 2]}", "{case: 2, serves: [2, 3], dummy_ids: [1, 2]}"),
        "lora_cases[2].serves: the file lists 2, its spec compiles to 1",
    ),
    "dispatch-graphs": (
        sub("graphs: [FULL:1x1@0, PIECEWISE:1@0]", "graphs: [PIECEWISE:1@0]"),
        "dispatch[0].graphs[0]: the file says 'PIECEWISE:1@0', its spec compiles to 'FULL:1x1@0'",
    ),
    "deviation-text": (
        sub("no change: vLLM 0.31+ already spreads the remainder", "nothing"),
        "deviations[1].changes[0]: differs from what its spec compiles to",
    ),
    "graph-counts": (sub("total: 22", "total: 23"), "graph_counts.total: the file says 23, its spec compiles to 22"),
    "extra-key": (GOOD + "notes: hello\n", "notes: unknown key"),
    "missing-counts": (
        GOOD.split("graph_counts:")[0] + "# in capture order" + GOOD.split("# in capture order")[1],
        "graph_counts: is missing",
    ),
    "dispatch-key": (
        sub("lora_dispatch_key: kernel_slots", "lora_dispatch_key: slots"),
        "lora_dispatch_key: the file says 'slots'",
    ),
    "duplicate-key": (
        GOOD.replace("format_version: 2\n", "format_version: 2\nformat_version: 2\n", 1),
        "duplicate key 'format_version'",
    ),
    "python-tag": (
        sub("format_version: 2", "format_version: !!python/object/apply:os.system ['true']"),
        "could not determine a constructor",
    ),
    "truncated": (
        GOOD[: len(GOOD) // 2].rsplit("\n", 1)[0] + "\n  - {graph: PIECEWISE:8@0, dumm",
        "did not find expected ',' or '}'",
    ),
    "empty": ("", "a plan must be a YAML mapping (got NoneType)"),
    "spec-not-plan": ("lora: {enabled: true}\n", "not a capplan plan (no format_version) but a spec (compile it first"),
    "huge-spec": (
        sub(
            "scheduler: {max_num_seqs: 4, max_num_batched_tokens: 64,",
            "scheduler: {max_num_seqs: 1024, max_num_batched_tokens: 16384,",
        )
        .replace("lora: {enabled: true, max_loras: 2,", "lora: {enabled: true, max_loras: 512,", 1)
        .replace(
            "cudagraph: {mode: FULL_AND_PIECEWISE,",
            f"cudagraph: {{mode: FULL_AND_PIECEWISE, capture_sizes: [{SIZES}],",
            1,
        ),
        "spec: the plan would have up to 49152 graphs, more than a plan file can hold (200000 entries)",
    ),
}

if __name__ == "__main__":
    for old in HERE.glob("plan-*.plan.yaml"):
        old.unlink()
    for name, (text, expect) in CASES.items():
        (HERE / f"plan-{name}.plan.yaml").write_text(f"# expect: {expect}\n{text}")
    print(f"wrote {len(CASES)} bad plans")
