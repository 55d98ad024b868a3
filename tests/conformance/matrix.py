"""The support matrix: every supported vLLM release, checked on CPU against its own code.

    python -m tests.conformance.matrix [RELEASE ...]

Prepares the oracle for each release (tests/conformance/oracle/setup_oracle.sh:
its wheel's Python files, downloaded once), then runs the conformance tier
once per release: planning (capture sizes, LoRA cases and map, every
descriptor in capture order, every dummy, every dispatch decision over a dense
grid, with `fixes: []`), the runtime's contract and hooks against the
release's real classes, and DP sync between two ranks. Writes the results,
dated, to tests/conformance/matrix-last-run.txt. Exit 0 when every release
passes.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from capplan.releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
RESULTS = Path(__file__).with_name("matrix-last-run.txt")


def main(argv: list[str]) -> int:
    chosen = argv or list(RELEASES)
    unknown = [r for r in chosen if r not in RELEASES]
    if unknown:
        print(f"error: not supported releases: {unknown}; supported: {list(RELEASES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "CAPPLAN_ORACLE_RELEASES": " ".join(chosen), "CAPPLAN_ORACLE_DIR": str(ORACLE_DIR)}
    print(f"[matrix] preparing the oracle for {', '.join(chosen)}", file=sys.stderr, flush=True)
    subprocess.run(
        ["bash", str(ROOT / "tests/conformance/oracle/setup_oracle.sh"), str(ORACLE_DIR)], env=env, check=True
    )
    commit = _commit()
    rows, counts, ok = [], [], True
    for release in chosen:
        print(f"[matrix] vLLM {release}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(
            # One worker per core, as in CI: most of the time is the oracle's subprocesses.
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "tests/conformance"],
            env={**env, "CAPPLAN_ORACLE_RELEASES": release, "CAPPLAN_REQUIRE_ORACLE": "1"},
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - start
        summary = next(
            (line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
            f"pytest exited {proc.returncode}",
        )
        summary = re.sub(r"\s+in [\d.]+s.*$", "", summary.strip("= "))
        passed = proc.returncode == 0
        ok &= passed
        rows.append(
            f"| {release} | {RELEASES[release].group} | {'yes' if passed else 'NO'} | {summary} | {seconds:.0f} s |"
        )
        counts += [f"- {release}: {line}" for line in proc.stdout.splitlines() if line.startswith("conformance ")]
        if not passed:
            print(proc.stdout[-3000:], file=sys.stderr)
    text = "\n".join(
        [
            f"capplan conformance matrix, {datetime.date.today().isoformat()}, Python {platform.python_version()}, "
            f"{platform.machine()} CPU (python -m tests.conformance.matrix), capplan {commit}",
            "",
            "| vLLM release | group | passes | conformance tier (planning, runtime contract and hooks, DP sync) | time |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "What each release's run compared:",
            "",
            *counts,
            "",
        ]
    )
    RESULTS.write_text(text)
    print(text)
    return 0 if ok else 1


def _commit() -> str:
    """The commit the matrix runs, and "with uncommitted changes" where the tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "(not a git checkout)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
