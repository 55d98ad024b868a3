"""Pull-request check for capture plans checked in next to their specs.

1. `capplan compile SPEC --check` for every spec: a plan that is not exactly
   what its spec compiles to fails the job, with the command that fixes it.
2. For every plan file the pull request changes, `capplan diff --format
   markdown` against the base revision goes into the job summary
   ($GITHUB_STEP_SUMMARY; stdout when unset), so reviewers read graphs added
   and removed per mode and LoRA case, not 400 lines of YAML.

    python examples/ci/plan_review.py --base origin/main --specs 'configs/*.yaml' --plan-dir examples

Exit 0 when every plan is up to date, 1 when one is stale (the summary is
written either way), 2 on bad usage. Needs git and capplan on PATH.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True)


def check_specs(specs: list[str], plan_dir: str | None) -> list[str]:
    """The stale-plan lines (`error: plan is stale ...: run ...`), one per stale spec."""
    problems = []
    for spec in specs:
        args = ["capplan", "compile", spec, "--check"] + (["--plan-dir", plan_dir] if plan_dir else [])
        proc = _run(args)
        if proc.returncode != 0:
            problems.append(proc.stderr.strip() or f"capplan compile {spec} --check failed ({proc.returncode})")
    return problems


def changed_plans(base: str) -> list[str]:
    proc = _run(["git", "diff", "--name-only", "--diff-filter=AMR", f"{base}...HEAD", "--", "*.plan.yaml"])
    if proc.returncode != 0:
        raise SystemExit(f"error: git diff against {base}: {proc.stderr.strip()}")
    return [line for line in proc.stdout.splitlines() if line]


def plan_diff(base: str, path: str, scratch: Path) -> str:
    """Markdown for one changed plan: the semantic diff, or why there is none."""
    old = _run(["git", "show", f"{base}:{path}"])
    if old.returncode != 0:
        shown = _run(["capplan", "show", path])
        first = shown.stdout.splitlines()[0] if shown.returncode == 0 and shown.stdout else shown.stderr.strip()
        return f"### New plan `{path}`\n\n{first}\n"
    old_path = scratch / (path.replace("/", "__") + ".base.plan.yaml")
    old_path.write_text(old.stdout, encoding="utf-8")
    diff = _run(["capplan", "diff", str(old_path), path, "--format", "markdown"])
    if diff.returncode in (0, 2) and diff.stdout:  # 0: equal, 2: different
        return diff.stdout.replace(f"`{old_path}`", f"`{base}:{path}`")
    return f"### `{path}`\n\nNot compared: {diff.stderr.strip()}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision the pull request merges into")
    parser.add_argument("--specs", default="configs/*.yaml", help="glob of spec files (default: configs/*.yaml)")
    parser.add_argument("--plan-dir", help="folder the plans live in (default: next to each spec)")
    args = parser.parse_args(argv)
    specs = sorted(p for p in glob.glob(args.specs) if not p.endswith(".plan.yaml"))
    if not specs:
        print(f"error: no spec matches {args.specs!r}", file=sys.stderr)
        return 2
    stale = check_specs(specs, args.plan_dir)
    parts = ["## Capture plans\n"]
    if stale:
        parts.append("**Stale plans** (the spec changed, the plan did not):\n")
        parts += [f"- `{line.removeprefix('error: ')}`" for line in stale]
        parts.append("")
    else:
        parts.append(f"All {len(specs)} plan(s) are what their specs compile to.\n")
    with tempfile.TemporaryDirectory() as scratch:
        changed = changed_plans(args.base)
        parts += [plan_diff(args.base, path, Path(scratch)) for path in changed]
    if not changed:
        parts.append("No plan changed in this pull request.\n")
    summary = "\n".join(parts)
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(summary + "\n")
    else:
        sys.stdout.write(summary + "\n")
    for line in stale:
        print(line, file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
