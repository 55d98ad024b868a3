"""What capplan's plugin costs vLLM's API server where it loads: the seconds to build `vllm serve`'s
parser (vLLM loads its general plugins while it adds the engine arguments) and the vLLM modules that
build imports, in fresh processes on the oracle's Python, interleaved: vLLM alone (no plugin),
the plugin with no plan (capplan installed, not applied), the plugin with a plan.

    python -m bench.server_parser PLAN [--runs N] [--version 0.33.0]

Prints one line per run and the medians. vLLM's import is done before the clock starts."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "conformance"))
from lazy_hooks_check import build_server_parser, vllm_modules
import vllm.plugins, vllm.entrypoints.cli.serve, vllm.utils.argparse_utils  # imported before the clock
arm = sys.argv[1]
from capplan.runtime import plugin
before = len(vllm_modules())
t = time.perf_counter()
build_server_parser(None if arm == "alone" else plugin.register)
print(json.dumps({"arm": arm, "seconds": round(time.perf_counter() - t, 3), "modules": len(vllm_modules()) - before}))
"""


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__)
    plan = str(Path(args[0]).resolve())
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 5
    version = args[args.index("--version") + 1] if "--version" in args else "0.33.0"
    oracle = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
    path = os.pathsep.join([str(oracle / "src" / version), str(ROOT / "src"), str(ROOT)])
    got: dict[str, list[dict]] = {"alone": [], "no plan": [], "plan": []}
    for _ in range(runs):
        for arm in got:
            env = {**os.environ, "PYTHONPATH": path}
            env.pop("CAPPLAN_PLAN", None)
            if arm == "plan":
                env["CAPPLAN_PLAN"] = plan
            proc = subprocess.run([str(oracle / "venv" / "bin" / "python"), "-c", ONE, arm, str(ROOT)],
                                  env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{arm}: {proc.stderr.strip().splitlines()[-1:]}")
            one = json.loads(proc.stdout.strip().splitlines()[-1])
            got[arm].append(one)
            print(json.dumps(one), flush=True)
    for arm, ones in got.items():
        print(f"{arm}: median {statistics.median(o['seconds'] for o in ones):.3f} s, "
              f"{statistics.median(o['modules'] for o in ones):.0f} vLLM modules imported ({len(ones)} runs)")  # fmt: skip


if __name__ == "__main__":
    main()
