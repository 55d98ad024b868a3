"""Every rank of an engine must run the same plan, or none may start.

The ranks of an MoE deployment pad to one token count every step; two ranks
with different plans would pick graphs of different sizes and desynchronise
(docs/design.md failure class 7). TP and PP ranks run every capture and every
step together: a rank capturing vLLM's own graphs (a node started without the
plan) or another plan's would pair its collectives with the wrong graphs of
the others. Before anything is captured, each rank all-gathers its plan
identity and its own verdict on the plan (does it match this rank's engine?)
over vLLM's world group (its CPU/gloo group: every TP, PP and padded DP rank,
on every node). Every rank then takes the same decision: start, or refuse
naming the rank at fault. A rank that refuses alone would leave the others
blocked in the next collective, so nobody raises before the exchange.

A rank started without a plan takes part too (the plugin installs only this
check then) and reports "no plan", so a launch that forgot CAPPLAN_PLAN on one
rank or node fails at start instead of hanging or running another graph set.
"""

from __future__ import annotations

from typing import Any

from capplan.runtime.engine_check import PlanMismatch
from capplan.schemas.plan import Plan

NO_PLAN = "no plan"
AUDIT = "CAPPLAN_DP_AUDIT"
AUDITED = "|audit"  # an identity's suffix where CAPPLAN_DP_AUDIT is on: its check is a collective of every step


def plan_identity(plan: Plan, audit: bool = False) -> str:
    """The spec determines the plan, and the fingerprint the graph set: both must agree. So must
    `audit` (CAPPLAN_DP_AUDIT under DP), whose check all-reduces at every step: on one rank alone,
    that collective would pair with another rank's next one."""
    return f"{plan.spec_hash}|{plan.fingerprint}" + (AUDITED if audit else "")


def _short(identity: str) -> str:
    return identity if identity == NO_PLAN else identity.split("|")[0][:19]


def decide(gathered: list[tuple[str, str | None]], rank: int, rank_label: str = "") -> str | None:
    """The one-line refusal every rank raises, or None to start. Pure: tested without torch."""
    identities = [g[0] for g in gathered]
    refused = [(i, why) for i, (_, why) in enumerate(gathered) if why]
    if len(set(identities)) > 1:
        if NO_PLAN not in identities and len({i.removesuffix(AUDITED) for i in identities}) == 1:
            on = ", ".join(str(i) for i, g in enumerate(identities) if g.endswith(AUDITED))
            return (
                f"capplan{rank_label}: CAPPLAN_DP_AUDIT=1 is set on rank(s) {on} only; its check "
                "all-reduces at every step, which every rank must do. Nothing was captured. Set it "
                "alike on every rank"
            )
        ranks = "; ".join(f"rank {i}: {_short(g)}" for i, g in enumerate(identities))
        also = "".join(f" Rank {i} also refused its own plan: {why}" for i, why in refused)
        return (
            f"capplan{rank_label}: the engine's ranks loaded different plans ({ranks}). Nothing was "
            f"captured. Start every rank, on every node, with the same CAPPLAN_PLAN (capplan apply "
            f"does).{also}"
        )
    if not refused:
        return None
    own = next((why for i, why in refused if i == rank), None)
    if own is not None:
        return own
    i, why = refused[0]
    return (
        f"capplan{rank_label}: rank {i} refused the plan, so this rank stops too. Nothing was "
        f"captured. Rank {i} said: {why}"
    )


def check_same_plan(identity: str, problem: str | None = None, group: Any = None, rank_label: str = "") -> None:
    """All-gather (identity, problem) and raise PlanMismatch on every rank unless all agree and none objects."""
    import torch.distributed as dist

    gathered: list[tuple[str, str | None] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (identity, problem), group=group)
    verdict = decide([g if g is not None else (NO_PLAN, None) for g in gathered], dist.get_rank(group), rank_label)
    if verdict is not None:
        raise PlanMismatch(verdict)


def audit_on() -> bool:
    """Whether CAPPLAN_DP_AUDIT is on in this process (the plan check makes the DP ranks agree)."""
    import os

    return os.environ.get(AUDIT) == "1"


def agree_across_ranks(identity: str, problem: str | None, parallel_config: Any) -> None:
    """Exchange this process's plan identity and verdict with every rank of the engine (vLLM's
    world group: its TP and PP ranks, on every node, and the DP ranks that pad to one another);
    every rank refuses alike. Nothing to exchange in a process of one rank, outside
    torch.distributed (the single-process checks), or under elastic EP, whose world group is
    not one torch.distributed knows (a plan refuses elastic EP on every rank alike, by the
    engine check)."""
    import torch.distributed as dist

    if not dist.is_initialized() or getattr(parallel_config, "enable_elastic_ep", False):
        return
    from vllm.distributed import parallel_state

    world = parallel_state.get_world_group()
    if world.world_size > 1:
        check_same_plan(identity, problem, world.cpu_group, f" (rank {world.rank_in_group})")


def launch_rank(parallel_config: Any) -> int:
    """This engine's DP rank in the launch: `data_parallel_index`, which vLLM sets for every
    engine (a dense model's independent engines all hold data_parallel_rank 0)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index) if type(index) is int else int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
