"""One rank of the two-process plan check (torch.distributed, gloo, CPU).

    python dp_check_worker.py RANK PORT PLAN_PATH
Prints "ok" or the one-line refusal.
"""

import sys

import torch.distributed as dist

from capplan.planfile import load_plan
from capplan.runtime.dp_check import check_same_plan, plan_identity
from capplan.runtime.engine_check import PlanMismatch

rank, port, plan_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    check_same_plan(plan_identity(load_plan(plan_path)), rank_label=f" (rank {rank})")
    print("ok")
except PlanMismatch as exc:
    print(f"refused: {exc}")
finally:
    dist.destroy_process_group()
