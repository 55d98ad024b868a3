"""Launch vLLM offline data parallel (DP=2, expert parallel), one process per rank.

    python tests/gpu/dp_launch.py MODEL_DIR OUT_DIR --specialize-active 1 [--rank1-plan PLAN]

vLLM's own offline SPMD launch: each rank is a separate process with
VLLM_DP_RANK, VLLM_DP_RANK_LOCAL, VLLM_DP_SIZE=2 and VLLM_DP_MASTER_IP/PORT
set, and builds its own LLM (tests/gpu/dp_rank.py). Run it under
`capplan apply --runner mrv2 PLAN -- python tests/gpu/dp_launch.py ...` and
both ranks inherit CAPPLAN_PLAN. --rank1-plan gives rank 1 another plan (the
mismatch test). Exits 0 when both ranks do, 124 when they hang.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--specialize-active", type=int, default=1)
    parser.add_argument("--rank1-plan")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "VLLM_DP_RANK": str(rank),
            "VLLM_DP_RANK_LOCAL": str(rank),
            "VLLM_DP_SIZE": "2",
            "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(port),
        }
        if rank == 1 and args.rank1_plan:
            env["CAPPLAN_PLAN"] = args.rank1_plan
        log = (args.out_dir / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "dp_rank.py"),
                    args.model_dir,
                    str(args.out_dir / f"rank{rank}.json"),
                    "--specialize-active",
                    str(args.specialize_active),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None, None]
    while None in codes and time.monotonic() < deadline:
        time.sleep(1)
        codes = [p.poll() for p in procs]
    if None in codes:
        for p in procs:
            p.kill()
        print(f"dp_launch: ranks still running after {args.timeout:.0f} s (exit codes {codes}): hang", flush=True)
        return 124
    print(f"dp_launch: rank exit codes {codes}", flush=True)
    return max(abs(c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
