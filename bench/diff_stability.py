"""How much of a plan's raw `git diff` a one-field spec change rewrites.

For each example spec and edit: compile the spec and the edited spec with the
`capplan` on PATH, then count the raw `git diff --no-index` lines (added +
removed), the graph lines present in both plans, and how many of those stay
byte-identical. Run: python -m bench.diff_stability
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("qwen3-8b-multilora.yaml", "max_loras: 8 -> 4", r"max_loras: 8", "max_loras: 4"),
    ("gemma3-27b-full-decode-only.yaml", "max_num_seqs: 64 -> 68", r"max_num_seqs: 64", "max_num_seqs: 68"),
    ("mixtral-dp2-lora.yaml", "max_num_seqs: 64 -> 68", r"max_num_seqs: 64", "max_num_seqs: 68"),
    ("qwen3-8b-multilora.yaml", "capture size 100 added", r"capture_sizes: null", None),
]
# vLLM 0.33's default sizes for the qwen3 example, written out so that only the added size differs.
QWEN3_SIZES = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]


def _graph_lines(text: str) -> list[str]:
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("graphs:"):
            inside = True
            continue
        if inside and not line.startswith("  "):
            inside = False
        if inside:
            out.append(line)
    return out


def _sizes(sizes: list[int]) -> str:
    return "capture_sizes: [" + ", ".join(map(str, sizes)) + "]"


def main() -> int:
    print(f"{'spec':36} {'change':30} {'plan lines':>10} {'diff lines':>10} {'graphs kept':>12} {'identical':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, pattern, repl in CASES:
            spec = (ROOT / "configs" / name).read_text()
            if repl is None:  # the size edit: both sides spell the list out
                spec = spec.replace("capture_sizes: null", _sizes(QWEN3_SIZES))
                pattern, repl = re.escape(_sizes(QWEN3_SIZES)), _sizes(sorted([*QWEN3_SIZES, 100]))
            edited = re.sub(pattern, repl, spec, count=1)
            assert edited != spec, (name, pattern)
            plans = []
            for tag, text in (("old", spec), ("new", edited)):
                folder = Path(tmp) / tag
                folder.mkdir(exist_ok=True)
                (folder / name).write_text(text)
                subprocess.run(["capplan", "compile", str(folder / name)], check=True, capture_output=True)
                plans.append(folder / name.replace(".yaml", ".plan.yaml"))
            numstat = subprocess.run(
                ["git", "diff", "--no-index", "--numstat", *map(str, plans)], capture_output=True, text=True
            ).stdout.split()
            changed = int(numstat[0]) + int(numstat[1])
            old_text, new_text = plans[0].read_text(), plans[1].read_text()
            old_g, new_g = _graph_lines(old_text), set(_graph_lines(new_text))
            # "kept": graphs present in both plans, by address (format 2) or descriptor (format 1)
            keyed = lambda line: re.search(r"graph: [^,}]+|descriptor: \{[^}]*\}", line).group()  # noqa: E731
            new_keys = {keyed(line) for line in new_g}
            kept = [line for line in old_g if keyed(line) in new_keys]
            identical = sum(line in new_g for line in kept)
            print(f"{name:36} {label:30} {len(old_text.splitlines()):>10} {changed:>10} {len(kept):>12} {identical:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
