"""Every data-parallel rank must run the same plan.

The ranks of an MoE deployment pad to one token count every step; two ranks
with different plans would pick graphs of different sizes and desynchronise
(DESIGN.md failure class 7). Before anything is captured, each rank
all-gathers its plan identity over vLLM's DP group (its CPU/gloo group) and
refuses to start unless all are equal.
"""

from __future__ import annotations

from capplan.runtime.fingerprint import PlanMismatch
from capplan.schemas.plan import Plan


def plan_identity(plan: Plan) -> str:
    """The spec determines the plan, and the fingerprint the graph set: both must agree."""
    return f"{plan.spec_hash}|{plan.fingerprint}"


def check_same_plan(identity: str, group=None, rank_label: str = "") -> None:
    import torch.distributed as dist

    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, identity, group=group)
    if len(set(gathered)) > 1:
        ranks = "; ".join(f"rank {i}: {g.split('|')[0][:19] if g else 'no plan'}" for i, g in enumerate(gathered))
        raise PlanMismatch(
            f"capplan{rank_label}: data-parallel ranks loaded different plans ({ranks}). Nothing was "
            "captured. Start every rank with the same CAPPLAN_PLAN (capplan apply does)"
        )
