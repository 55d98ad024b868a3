"""How the ranks of one engine decide together what they capture before it is ready.

A capture runs the ranks' collectives, so what one rank reads of its memory must never make it
capture apart from the others: with several TP or PP ranks every decision a reading feeds is
taken by all of them at once, over the TP and PP groups' CPU side, which every rank reaches at
the same point of the start-up capture. A single rank decides alone (`OneRank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from capplan.runtime.hooking import Hook, check_attributes

RANKS_HOOKS = tuple(
    Hook(
        f"deferred.ranks_{group}",
        f"vllm.distributed.parallel_state:get_{group}_group",
        "an engine of several TP or PP ranks decides what it captures before it is ready on every rank's "
        "memory readings at once (an all-reduce over the group's CPU side), so no rank captures apart",
        attributes=("cpu_group", "world_size"),
    )
    for group in ("tp", "pp")
)


class Ranks(Protocol):
    """The engine's TP and PP ranks, as one process votes with them."""

    single: bool  # the engine's only TP and PP rank

    def agreed(self, yes: bool) -> bool:
        """Yes only where every rank says yes."""
        ...

    def joined(self, values: set[int]) -> list[int]:
        """`values` joined with every rank's, sorted."""
        ...


class OneRank:
    """A single rank: its own answer."""

    single = True

    def agreed(self, yes: bool) -> bool:
        return yes

    def joined(self, values: set[int]) -> list[int]:
        return sorted(values)


class RankGroups:
    """Several TP or PP ranks: an all-reduce (MIN) or all-gather over vLLM's groups' CPU side."""

    single = False

    def __init__(self, groups: Callable[[], list[Any]] | None = None) -> None:
        self.groups = groups or vllm_groups  # the groups' CPU side; vLLM's TP and PP groups

    def agreed(self, yes: bool) -> bool:
        import torch
        import torch.distributed as dist

        vote = torch.tensor([int(yes)], dtype=torch.int32)
        for group in self.groups():
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
        return bool(vote.item())

    def joined(self, values: set[int]) -> list[int]:
        import torch.distributed as dist

        for group in self.groups():
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, sorted(values), group=group)
            values = {v for got in gathered for v in got}
        return sorted(values)


def vllm_groups() -> list[Any]:
    """The process groups (CPU side) of this engine's ranks: vLLM's TP and PP groups of more
    than one rank."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    groups = [get_tp_group(), get_pp_group()]  # RANKS_HOOKS' order
    for hook, group in zip(RANKS_HOOKS, groups):
        check_attributes(hook, group)
    return [group.cpu_group for group in groups if group.world_size > 1]


def ranks_of(manager: Any) -> Ranks:
    """The ranks of the engine whose vLLM graph manager this is."""
    one = manager.tp_size == 1 and manager.is_first_pp_rank and manager.is_last_pp_rank
    return OneRank() if one else RankGroups()
