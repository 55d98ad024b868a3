"""Dispatch targets per token count, and how they change between two plans.

Shared by the deviations (a plan against its exact-vLLM twin) and `capplan
diff` (two plans): what a mixed batch and a uniform-decode batch of N tokens
replay in each LoRA case, merged into token runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from capplan.planner.dispatch import Batch, Dispatcher, beyond_spec
from capplan.schemas.plan import Descriptor, DispatchRange, Plan, PlannedGraph


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


def _targets(plan: Tables, ids: list[int], query_len: int | None = None) -> tuple[str, str]:
    """(graph a mixed batch replays, graph a uniform batch of `query_len` tokens per request
    replays: the plan's decode length unless given) from a candidate list. Only a graph captured
    for that token count per request serves a uniform batch; another one replays what a mixed
    batch of its tokens does (a plan of 2 speculative tokens replays 1-token decode steps
    PIECEWISE)."""
    descs = [plan.graphs[i].descriptor for i in ids]
    mixed = next((d for d in descs if d.uniform_token_count is None), None)
    q = plan.decode_query_len if query_len is None else query_len
    decode = next((d for d in descs if d.uniform_token_count == q), mixed)
    return _label(mixed), _label(decode)


UNIFORM = "uniform-decode"


def uniform_kind(query_len: int | None) -> str:
    """The batch kind of uniform batches: `uniform-decode`, or `uniform-decode x3` where the two
    plans decode different token counts per request (3 each, here)."""
    return UNIFORM if query_len is None else f"{UNIFORM} x{query_len}"


def query_len_of(kind: str) -> int | None:
    """The tokens per request a kind names (`uniform_kind`), or None."""
    return int(kind.rpartition(" x")[2]) if kind.startswith(UNIFORM + " x") else None


EAGER = "eager"


def _label(d: Descriptor | None) -> str:
    return EAGER if d is None else f"{d.cg_mode}:{d.num_tokens}"


def _expand(plan: Tables) -> dict[tuple[int, int], list[int]]:
    return {(row.lora_case, n): row.candidates for row in plan.dispatch for n in range(row.lo, row.hi + 1)}


def _shape(label: str) -> str:
    """Mode only: the exact size follows from the token count."""
    return label.split(":")[0]


Refusal = Callable[[Batch], "str | None"]
"""Why a deployment never schedules a batch, or None (`dispatch.beyond_spec` bound to a spec)."""

NOT_SCHEDULED = "not scheduled"


NONE = -1
"""A lane's case on a side that never schedules its adapter mix."""


@dataclass(frozen=True, order=True)
class Lane:
    """Batches of one adapter mix, compared across two plans: the LoRA case each plan
    dispatches them to (the same case on both sides unless the LoRA settings changed), and
    the fewest adapters (and base requests) that reach that pair of cases."""

    adapters: int
    base: bool
    old_case: int
    new_case: int

    def label(self) -> str:
        old, new = (str(c) if c != NONE else "none" for c in (self.old_case, self.new_case))
        return old if old == new else f"{old} -> {new}"

    @property
    def requests(self) -> int:
        """The fewest requests such a batch holds: one per adapter, one more for base requests."""
        return self.adapters + self.base


def case_lanes(cases: Sequence[int]) -> list[Lane]:
    """One lane per LoRA case, the same case on both sides (a plan against its exact-vLLM twin)."""
    return [Lane(0, False, c, c) for c in cases]


def lora_lanes(old: Plan, new: Plan) -> list[Lane]:
    """Every adapter mix either deployment schedules, as the pair of LoRA cases the two plans
    dispatch it to: one lane per pair and per which side schedules it. A change of max_loras
    moves every LoRA case, and each moved case is compared, not only the cases both plans
    capture."""
    sides = [(Dispatcher(p), p.spec) for p in (old, new)]
    top = max((p.spec.lora.max_loras for p in (old, new) if p.spec.lora.enabled), default=0)
    lanes: dict[tuple[int, int, bool, bool], Lane] = {}
    for adapters in range(top + 1):
        for base in (False, True) if adapters else (False,):
            mix = Batch(1, 1, 1, adapters, base)
            old_ok, new_ok = (beyond_spec(mix, spec) is None for _, spec in sides)
            # A side that never schedules the mix has no case for it (NONE): such mixes share a lane.
            old_case, new_case = (
                d.lora_case(d.lora_count(mix)) if ok else NONE for (d, _), ok in zip(sides, (old_ok, new_ok))
            )
            lanes.setdefault((old_case, new_case, old_ok, new_ok), Lane(adapters, base, old_case, new_case))
    return sorted(lanes.values())


def _kind_batch(kind: str, n: int, dql: int, lane: Lane) -> Batch | None:
    """The least demanding batch of its kind, token count and adapter mix, or None when no
    batch is (a request per adapter): a mixed batch of n tokens can be as few requests as its
    adapters need; a uniform-decode one is n / dql requests of dql tokens."""
    need = max(1, lane.requests)
    if kind == "mixed":
        return Batch(need, n, n - need + 1, lane.adapters, lane.base) if need <= n else None
    q = query_len_of(kind) or dql
    if n // q < need:
        return None
    return Batch(n // q, n, q, lane.adapters, lane.base, uniform_token_count=q)


def _walk(
    old: Tables,
    new: Tables,
    reachable: Callable[[int], set[int]] | None,
    refusals: tuple[Refusal, Refusal] | None,
    lanes: Sequence[Lane],
) -> Iterator[tuple[str, Lane, int, str, str, str | None, str | None]]:
    """(kind, lane, tokens, old target, new target, why the old spec never schedules it,
    why the new one never does) for every batch kind, lane and token count both tables cover."""
    before, after = _expand(old), _expand(new)
    top = max([k[1] for k in before] + [k[1] for k in after], default=0)
    # Uniform batches of each plan's decode length: where the plans decode different token counts
    # per request (speculative tokens changed), batches of each length are compared in both
    # plans, each kind naming its length (the other plan replays them as mixed batches).
    same = new.decode_query_len == old.decode_query_len
    lengths: list[int | None] = [None] if same else [q for q in sorted({old.decode_query_len, new.decode_query_len})]
    for lane in lanes:
        for n in range(1, top + 1):
            old_ids, new_ids = before.get((lane.old_case, n), []), after.get((lane.new_case, n), [])
            o, w = _targets(old, old_ids), _targets(new, new_ids)
            kinds = []
            if lane.requests <= n and (reachable is None or lane.new_case in reachable(n)):
                kinds.append(("mixed", o[0], w[0]))
            for q in lengths:
                per = new.decode_query_len if q is None else q
                if (
                    n % per
                    or lane.requests > n // per
                    or (reachable is not None and lane.new_case not in reachable(n // per))
                ):
                    continue
                kinds.append((uniform_kind(q), _targets(old, old_ids, per)[1], _targets(new, new_ids, per)[1]))
            for kind, a, b in kinds:
                old_no = new_no = None
                if refusals is not None:
                    batch = _kind_batch(kind, n, new.decode_query_len, lane)
                    if batch is None:
                        continue
                    old_no, new_no = refusals[0](batch), refusals[1](batch)
                yield kind, lane, n, a, b, old_no, new_no


def _add(runs: dict[Lane, list[list[int]]], lane: Lane, n: int) -> None:
    lane_runs = runs.setdefault(lane, [])
    if lane_runs and lane_runs[-1][1] == n - 1:
        lane_runs[-1][1] = n
    else:
        lane_runs.append([n, n])


Runs = dict[tuple[str, str, str], dict[Lane, list[list[int]]]]
"""(batch kind, old target, new target) -> lane (LoRA cases) -> runs of token counts."""


def regions(
    runs: Runs, all_lanes: Sequence[Lane]
) -> Iterator[tuple[tuple[str, str, str], tuple[tuple[int, int], ...], tuple[Lane, ...], bool]]:
    """(key, token runs, lanes, every lane) per line: by batch kind, then by the smallest
    batch the line covers (not by the targets' text); lanes with the same runs share a line."""
    every_lane = sorted(all_lanes)
    ordered = sorted(runs.items(), key=lambda item: (item[0][0], min(r[0][0] for r in item[1].values()), item[0]))
    for key, by_lane in ordered:
        groups: dict[tuple[tuple[int, int], ...], list[Lane]] = {}
        for lane, lane_runs in sorted(by_lane.items()):
            groups.setdefault(tuple((lo, hi) for lo, hi in lane_runs), []).append(lane)
        for token_runs, lanes in groups.items():
            yield key, token_runs, tuple(lanes), lanes == every_lane and len(every_lane) > 1


def where_text(lanes: Sequence[Lane], every: bool) -> str:
    """`LoRA case 0`, `LoRA cases 0, 4`, `LoRA cases 0; 5 -> 7` (a case that moves: pairs apart by
    `;`), `all LoRA cases`."""
    if every:
        return "all LoRA cases"
    labels = [lane.label() for lane in lanes]
    sep = "; " if any("->" in label for label in labels) else ", "
    return "LoRA case" + ("s " if len(lanes) > 1 else " ") + sep.join(labels)


def _lines(runs: Runs, all_lanes: Sequence[Lane], tail: Callable[[str, str, str], str]) -> list[str]:
    lines = []
    for (kind, a, b), token_runs, lanes, every in regions(runs, all_lanes):
        count = sum(hi - lo + 1 for lo, hi in token_runs)
        sample = ", ".join(f"{lo}..{hi}" if lo != hi else f"{lo}" for lo, hi in token_runs[:6])
        more = ", ..." if len(token_runs) > 6 else ""
        lines.append(
            f"{kind} batches of {count} token count(s) ({sample}{more}; {where_text(lanes, every)}): {tail(kind, a, b)}"
        )
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
    lanes: Sequence[Lane] | None = None,
) -> Runs:
    """What `target_changes` lists, as runs (its docstring says which)."""
    runs: Runs = {}
    lanes = case_lanes(shared_cases(old, new)) if lanes is None else lanes
    for kind, lane, n, a, b, old_no, new_no in _walk(old, new, reachable, refusals, lanes):
        if new_no is not None:
            continue
        if not exact_sizes:
            a, b = _shape(a), _shape(b)
        if old_no is not None:
            # Batches only the new deployment makes: the mode they replay (the size follows
            # from the token count), one line per mode rather than one per graph.
            a, b = NOT_SCHEDULED, _shape(b)
        if a == b:
            if lane.old_case == lane.new_case or _shape(a) == EAGER:
                continue
            # the same size of another LoRA case's graphs (a dispatch change, whatever the spec's
            # change was: a fix removed, max_loras moved): one line per mode, the cases said
            a, b = _shape(a), _shape(b)
        _add(runs.setdefault((kind, a, b), {}), lane, n)
    return runs


def unscheduled_runs(
    old: Tables,
    new: Tables,
    refusals: tuple[Refusal, Refusal],
    reachable: Callable[[int], set[int]] | None = None,
    lanes: Sequence[Lane] | None = None,
) -> tuple[Runs, dict[tuple[str, str, str], str]]:
    """What `no_longer_scheduled` lists, as runs, and why the new deployment never makes each.
    The key's third part is the reason an adapter mix is refused whatever its size ("" when
    only the size is: one line per kind of refusal, not per batch)."""
    runs: Runs = {}
    why: dict[tuple[str, str, str], str] = {}
    lanes = case_lanes(shared_cases(old, new)) if lanes is None else lanes
    mix_refused = {lane: refusals[1](Batch(1, 1, 1, lane.adapters, lane.base)) or "" for lane in lanes}
    for kind, lane, n, a, _, old_no, new_no in _walk(old, new, reachable, refusals, lanes):
        if old_no is None and new_no is not None:
            key = (kind, _shape(a), mix_refused[lane])
            why.setdefault(key, new_no)
            _add(runs.setdefault(key, {}), lane, n)
    return runs, why


def target_changes(
    old: Tables,
    new: Tables,
    *,
    exact_sizes: bool = False,
    reachable: Callable[[int], set[int]] | None = None,
    refusals: tuple[Refusal, Refusal] | None = None,
    lanes: Sequence[Lane] | None = None,
) -> list[str]:
    """One line per (batch kind, old target, new target): token runs and LoRA cases.

    `lanes` says which LoRA cases are compared (`lora_lanes`: every adapter mix, by the case
    each plan dispatches it to); by default the LoRA cases both plans capture; with `exact_sizes` the
    lines name graph sizes ("PIECEWISE:8"), otherwise modes only. With
    `reachable` (request count -> the LoRA cases a batch of at most that many
    requests can dispatch to), pairs no batch reaches are left out: a mixed
    batch of N tokens holds at most N requests, a uniform-decode one N / dql.
    With `refusals` (the old and the new deployment's scheduling rule), only
    batches the new deployment schedules are compared; one only it schedules
    was "not scheduled" before (`no_longer_scheduled` lists the other way round).
    """
    lanes = case_lanes(shared_cases(old, new)) if lanes is None else lanes
    runs = target_runs(old, new, exact_sizes=exact_sizes, reachable=reachable, refusals=refusals, lanes=lanes)
    return _lines(runs, lanes, lambda kind, a, b: f"{a} -> {b}")


def no_longer_scheduled(
    old: Tables,
    new: Tables,
    refusals: tuple[Refusal, Refusal],
    reachable: Callable[[int], set[int]] | None = None,
    lanes: Sequence[Lane] | None = None,
) -> list[str]:
    """The batches only the old deployment schedules: one line per batch kind and the mode the
    old plan replayed them with, saying why the new deployment never makes them."""
    lanes = case_lanes(shared_cases(old, new)) if lanes is None else lanes
    runs, why = unscheduled_runs(old, new, refusals, reachable, lanes)
    return _lines(
        runs,
        lanes,
        lambda kind, a, b: f"replayed {a} in the old plan; the new spec never makes them ({why[(kind, a, b)]})",
    )
