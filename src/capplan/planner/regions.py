"""Dispatch targets per token count, and how they change between two plans.

Shared by the deviations (a plan against its exact-vLLM twin) and `capplan
diff` (two plans): what a mixed batch and a uniform-decode batch of N tokens
replay in each LoRA case, merged into token runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from capplan.planner.dispatch import Batch
from capplan.schemas.plan import Descriptor, DispatchRange, PlannedGraph


class Tables(Protocol):
    """What dispatch comparisons read of a plan: a Plan, or vLLM's own twin of one
    (deviations.ExactTwin, which recomputes only the dispatch ranges)."""

    @property
    def graphs(self) -> Sequence[PlannedGraph]: ...

    @property
    def dispatch(self) -> Sequence[DispatchRange]: ...

    @property
    def lora_capture_cases(self) -> Sequence[int]: ...

    @property
    def decode_query_len(self) -> int: ...


def _targets(plan: Tables, ids: list[int]) -> tuple[str, str]:
    """(graph a mixed batch replays, graph a uniform-decode batch replays) from a candidate list."""
    descs = [plan.graphs[i].descriptor for i in ids]
    mixed = next((d for d in descs if d.uniform_token_count is None), None)
    decode = next((d for d in descs if d.uniform_token_count == plan.decode_query_len), mixed)
    return _label(mixed), _label(decode)


def _label(d: Descriptor | None) -> str:
    return "eager" if d is None else f"{d.cg_mode}:{d.num_tokens}"


def _expand(plan: Tables) -> dict[tuple[int, int], list[int]]:
    return {(row.lora_case, n): row.candidates for row in plan.dispatch for n in range(row.lo, row.hi + 1)}


def _shape(label: str) -> str:
    """Mode only: the exact size follows from the token count."""
    return label.split(":")[0]


Refusal = Callable[[Batch], "str | None"]
"""Why a deployment never schedules a batch, or None (`dispatch.beyond_spec` bound to a spec)."""

NOT_SCHEDULED = "not scheduled"


def _kind_batch(kind: str, n: int, dql: int) -> Batch:
    """The least demanding batch of its kind and token count: a mixed batch of n tokens can be
    one request; a uniform-decode one is n / dql requests of dql tokens."""
    if kind == "mixed":
        return Batch(1, n, n)
    return Batch(n // dql, n, dql, uniform_token_count=dql)


def _walk(
    old: Tables,
    new: Tables,
    reachable: Callable[[int], set[int]] | None,
    refusals: tuple[Refusal, Refusal] | None,
) -> Iterator[tuple[str, int, int, str, str, str | None, str | None]]:
    """(kind, LoRA case, tokens, old target, new target, why the old spec never schedules it,
    why the new one never does) for every batch kind, case and token count both tables cover."""
    before, after = _expand(old), _expand(new)
    shared_cases = set(old.lora_capture_cases) & set(new.lora_capture_cases)
    top = max([k[1] for k in before] + [k[1] for k in after], default=0)
    dql = new.decode_query_len if new.decode_query_len == old.decode_query_len else 0
    for case in sorted(shared_cases):
        for n in range(1, top + 1):
            o = _targets(old, before.get((case, n), []))
            w = _targets(new, after.get((case, n), []))
            kinds = []
            if reachable is None or case in reachable(n):
                kinds.append(("mixed", o[0], w[0]))
            if dql and n % dql == 0 and (reachable is None or case in reachable(n // dql)):
                kinds.append(("uniform-decode", o[1], w[1]))
            for kind, a, b in kinds:
                old_no = new_no = None
                if refusals is not None:
                    batch = _kind_batch(kind, n, dql)
                    old_no, new_no = refusals[0](batch), refusals[1](batch)
                yield kind, case, n, a, b, old_no, new_no


def _add(runs: dict[int, list[list[int]]], case: int, n: int) -> None:
    case_runs = runs.setdefault(case, [])
    if case_runs and case_runs[-1][1] == n - 1:
        case_runs[-1][1] = n
    else:
        case_runs.append([n, n])


Runs = dict[tuple[str, str, str], dict[int, list[list[int]]]]
"""(batch kind, old target, new target) -> LoRA case -> runs of token counts."""


def regions(
    runs: Runs, all_cases: list[int]
) -> Iterator[tuple[tuple[str, str, str], tuple[tuple[int, int], ...], tuple[int, ...], bool]]:
    """(key, token runs, LoRA cases, every case) per line: by batch kind, then by the smallest
    batch the line covers (not by the targets' text); cases with the same runs share a line."""
    ordered = sorted(runs.items(), key=lambda item: (item[0][0], min(r[0][0] for r in item[1].values()), item[0]))
    for key, by_case in ordered:
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for case, case_runs in by_case.items():
            groups.setdefault(tuple((lo, hi) for lo, hi in case_runs), []).append(case)
        for token_runs, cases in groups.items():
            yield key, token_runs, tuple(cases), cases == all_cases and len(all_cases) > 1


def _lines(runs: Runs, all_cases: list[int], tail: Callable[[str, str, str], str]) -> list[str]:
    lines = []
    for (kind, a, b), token_runs, cases, every in regions(runs, all_cases):
        count = sum(hi - lo + 1 for lo, hi in token_runs)
        sample = ", ".join(f"{lo}..{hi}" if lo != hi else f"{lo}" for lo, hi in token_runs[:6])
        more = ", ..." if len(token_runs) > 6 else ""
        where = (
            "all LoRA cases" if every else "LoRA case" + ("s " if len(cases) > 1 else " ") + ", ".join(map(str, cases))
        )
        lines.append(f"{kind} batches of {count} token count(s) ({sample}{more}; {where}): {tail(kind, a, b)}")
    return lines


def shared_cases(old: Tables, new: Tables) -> list[int]:
    return sorted(set(old.lora_capture_cases) & set(new.lora_capture_cases))


def target_runs(
    old: Tables,
    new: Tables,
    *,
    exact_sizes: bool = False,
    reachable: Callable[[int], set[int]] | None = None,
    refusals: tuple[Refusal, Refusal] | None = None,
) -> Runs:
    """What `target_changes` lists, as runs (its docstring says which)."""
    runs: Runs = {}
    for kind, case, n, a, b, old_no, new_no in _walk(old, new, reachable, refusals):
        if new_no is not None:
            continue
        if not exact_sizes:
            a, b = _shape(a), _shape(b)
        if old_no is not None:
            a = NOT_SCHEDULED
        if a == b:
            continue
        _add(runs.setdefault((kind, a, b), {}), case, n)
    return runs


def unscheduled_runs(
    old: Tables,
    new: Tables,
    refusals: tuple[Refusal, Refusal],
    reachable: Callable[[int], set[int]] | None = None,
) -> tuple[Runs, dict[tuple[str, str], str]]:
    """What `no_longer_scheduled` lists, as runs, and why the new deployment never makes each."""
    runs: Runs = {}
    why: dict[tuple[str, str], str] = {}
    for kind, case, n, a, _, old_no, new_no in _walk(old, new, reachable, refusals):
        if old_no is None and new_no is not None:
            why.setdefault((kind, _shape(a)), new_no)
            _add(runs.setdefault((kind, _shape(a), ""), {}), case, n)
    return runs, why


def target_changes(
    old: Tables,
    new: Tables,
    *,
    exact_sizes: bool = False,
    reachable: Callable[[int], set[int]] | None = None,
    refusals: tuple[Refusal, Refusal] | None = None,
) -> list[str]:
    """One line per (batch kind, old target, new target): token runs and LoRA cases.

    Only LoRA cases both plans capture are compared; with `exact_sizes` the
    lines name graph sizes ("PIECEWISE:8"), otherwise modes only. With
    `reachable` (request count -> the LoRA cases a batch of at most that many
    requests can dispatch to), pairs no batch reaches are left out: a mixed
    batch of N tokens holds at most N requests, a uniform-decode one N / dql.
    With `refusals` (the old and the new deployment's scheduling rule), only
    batches the new deployment schedules are compared; one only it schedules
    was "not scheduled" before (`no_longer_scheduled` lists the other way round).
    """
    runs = target_runs(old, new, exact_sizes=exact_sizes, reachable=reachable, refusals=refusals)
    return _lines(runs, shared_cases(old, new), lambda kind, a, b: f"{a} -> {b}")


def no_longer_scheduled(
    old: Tables,
    new: Tables,
    refusals: tuple[Refusal, Refusal],
    reachable: Callable[[int], set[int]] | None = None,
) -> list[str]:
    """The batches only the old deployment schedules: one line per batch kind and the mode the
    old plan replayed them with, saying why the new deployment never makes them."""
    runs, why = unscheduled_runs(old, new, refusals, reachable)
    shared = shared_cases(old, new)
    return _lines(
        runs,
        shared,
        lambda kind, a, b: f"replayed {a} in the old plan; the new spec never makes them ({why[(kind, a)]})",
    )
