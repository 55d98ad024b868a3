"""Prove a plan free of docs/design.md's failure classes over the reachable batch space.

Every check walks the plan's own tables (graphs, dispatch ranges), never a
recompiled copy, so a mutated or hand-edited plan is judged on what it says;
a final check compares the plan with what its spec compiles to. The batch
space (num_reqs 1..max_num_seqs, num_tokens 1..max_num_batched_tokens,
uniform or mixed, 0..max_loras adapters with or without base requests, every
DP rank combination) is covered through the range structure: within one
dispatch range the candidates are fixed, so the worst batch of the range
decides.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from capplan.planner.dispatch import compatible
from capplan.planner.lora_cases import kernel_grid, reachable_cases, slots_by_case
from capplan.schemas.plan import Descriptor, Plan


@dataclass(frozen=True)
class FailureClass:
    """One of docs/design.md's failure classes (`number`), or a check of its own (None)."""

    number: int | None
    name: str

    @property
    def label(self) -> str:
        """`8: coverage hole`, or the name alone."""
        return self.name if self.number is None else f"{self.number}: {self.name}"


FAILURE_CLASSES: dict[str, FailureClass] = {
    "structure": FailureClass(None, "plan tables reference graphs that cannot serve them"),
    "coverage": FailureClass(8, "coverage hole"),
    "lora_kernels": FailureClass(1, "LoRA kernels missing from a graph"),
    "lora_ids": FailureClass(2, "LoRA graph warmed without a valid adapter mapping"),
    "lora_case": FailureClass(3, "graph warmed with the wrong active-LoRA count"),
    "lora_grid": FailureClass(6, "no-LoRA slot not counted"),
    "dummy_length": FailureClass(5, "dummy request too long"),
    "dp": FailureClass(7, "DP ranks can disagree"),
    "encoder_lora": FailureClass(11, "encoder graphs skip tower/connector LoRA"),
    "tiers": FailureClass(None, "deferred capture: a state where a batch has no valid graph"),
    "consistency": FailureClass(None, "hand edit: plan does not match its spec"),
}
CLASSES = {kind: c.label for kind, c in FAILURE_CLASSES.items()}  # kind -> `8: coverage hole`

BatchKind = Literal["mixed", "uniform-decode"]
Span = tuple[int, int]


@dataclass(frozen=True)
class Violation:
    """A failure the plan has: its `kind` (a key of FAILURE_CLASSES, so its failure class)
    and, per subclass, the graphs, tokens and cases involved. `code` names the subclass in
    JSON; `present.verify.violation_message` renders the sentence `capplan verify` prints."""

    kind: ClassVar[str]
    code: ClassVar[str]

    @property
    def failure_class(self) -> FailureClass:
        return FAILURE_CLASSES[self.kind]


# -- structure: tables that reference graphs that cannot serve them ------------------------------


@dataclass(frozen=True)
class GraphMisplaced(Violation):
    kind = "structure"
    code = "graph_misplaced"
    graph_id: int
    position: int


@dataclass(frozen=True)
class MalformedRange(Violation):
    """A dispatch range naming graph ids the plan does not have, or with lo > hi (no ids)."""

    kind = "structure"
    code = "malformed_range"
    lora_case: int
    lo: int
    hi: int
    unknown_ids: tuple[int, ...]


@dataclass(frozen=True)
class CandidateCannotHold(Violation):
    kind = "structure"
    code = "candidate_cannot_hold"
    lora_case: int
    lo: int
    hi: int
    graph: Descriptor


@dataclass(frozen=True)
class RangesOverlap(Violation):
    kind = "structure"
    code = "ranges_overlap"
    lora_case: int
    first: Span
    second: Span


@dataclass(frozen=True)
class DummyLayoutMismatch(Violation):
    kind = "structure"
    code = "dummy_layout"
    graph: Descriptor
    dummy_reqs: int
    dummy_tokens: int
    reqs: int
    tokens: int


@dataclass(frozen=True)
class DummyMaxQueryLen(Violation):
    kind = "structure"
    code = "dummy_max_query_len"
    graph: Descriptor
    max_query_len: int
    longest: int


@dataclass(frozen=True)
class KernelGridMismatch(Violation):
    kind = "structure"
    code = "kernel_grid"
    graph: Descriptor
    kernel_grid: int | None
    expected: int


@dataclass(frozen=True)
class TiersMalformed(Violation):
    """tiers.deferred lists a graph twice or one the plan lacks (`field` deferred), or
    tiers.fallback does not name one graph per deferred graph (`field` fallback)."""

    kind = "structure"
    code = "tiers_malformed"
    field: Literal["deferred", "fallback"]


# -- 8: coverage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CoverageHole(Violation):
    """Batches of a kind (more than `served` requests; 0: any) that run eager in these LoRA
    cases (`every_case`: all the plan captures) although a captured `cg_mode` graph could
    serve them."""

    kind = "coverage"
    code = "coverage_hole"
    batch_kind: BatchKind
    served: int
    lora_cases: tuple[int, ...]
    every_case: bool
    token_runs: tuple[Span, ...]
    cg_mode: str

    @property
    def token_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.token_runs)


# -- 5: dummy length ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DummyTooLong(Violation):
    """A graph's dummy request longer than `limit` (max_model_len, or the graph's max_query_len)."""

    kind = "dummy_length"
    code = "dummy_too_long"
    graph: Descriptor
    longest: int
    limit: Literal["max_model_len", "max_query_len"]
    limit_tokens: int


@dataclass(frozen=True)
class DummyRunTooLong(Violation):
    """vLLM's profile or DP-idle dummy run holds a request longer than max_model_len; `fix`:
    what avoids it (`max_capture_size`: keep the largest PIECEWISE graph at most
    max_model_len; `dummy_remainder`: turn that fix on; `limits`: raise max_num_seqs or
    max_model_len)."""

    kind = "dummy_length"
    code = "dummy_run_too_long"
    run: str
    tokens: int
    longest: int
    max_model_len: int
    fix: Literal["max_capture_size", "dummy_remainder", "limits"]


@dataclass(frozen=True)
class PiledRemainder(Violation):
    """`count` dummy batches pile the token remainder on one request; the worst is `graph`'s."""

    kind = "dummy_length"
    code = "piled_remainder"
    count: int
    graph: Descriptor
    longest: int
    even: int


# -- 1, 2, 3: LoRA warm-up -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoraOffGraphCarriesLora(Violation):
    kind = "lora_case"
    code = "lora_off_graph_carries_lora"
    graph: Descriptor


@dataclass(frozen=True)
class NoLoraGraphWarmed(Violation):
    kind = "lora_case"
    code = "no_lora_graph_warmed"
    graph: Descriptor
    adapters: tuple[int, ...]


@dataclass(frozen=True)
class WrongAdapterCount(Violation):
    kind = "lora_case"
    code = "wrong_adapter_count"
    graph: Descriptor
    warmed: int
    needed: int


@dataclass(frozen=True)
class BadAdapterIds(Violation):
    kind = "lora_ids"
    code = "bad_adapter_ids"
    graph: Descriptor
    lora_ids: tuple[int, ...]
    max_loras: int


@dataclass(frozen=True)
class KernelsShortCircuit(Violation):
    """Every dummy request of a LoRA graph is -1: the kernels are not recorded."""

    kind = "lora_kernels"
    code = "kernels_short_circuit"
    graph: Descriptor


# -- 6: kernel grids -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShortKernelGrid(Violation):
    """Graphs of a LoRA case whose kernel grid is smaller than the `slots` an `example` batch
    dispatched to them brings."""

    kind = "lora_grid"
    code = "short_kernel_grid"
    lora_case: int
    graphs: tuple[Descriptor, ...]
    kernel_grid: int
    slots: int
    example: str


@dataclass(frozen=True)
class ShortFallbackGrid(Violation):
    """Deferred graphs (each with its stand-in) that fall back to a graph whose kernel grid
    is smaller than the `slots` their batches bring."""

    kind = "lora_grid"
    code = "short_fallback_grid"
    kernel_grid: int
    slots: int
    fallbacks: tuple[tuple[Descriptor, Descriptor], ...]


# -- 7: DP agreement -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DpDisagreement(Violation):
    """An agreed batch of `tokens` that pads to `low_padded` on one rank (its LoRA case and
    request count) and `high_padded` on another; padded == tokens: runs eager."""

    kind = "dp"
    code = "dp_disagreement"
    batch_kind: BatchKind
    tokens: int
    low_case: int
    low_reqs: int
    low_padded: int
    high_case: int
    high_reqs: int
    high_padded: int


@dataclass(frozen=True)
class DpMoreDisagreements(Violation):
    """How many more token counts DP ranks can disagree on than are listed."""

    kind = "dp"
    code = "dp_more"
    count: int


# -- consistency: the plan against its spec ------------------------------------------------------


@dataclass(frozen=True)
class DpSizeMismatch(Violation):
    kind = "consistency"
    code = "dp_size"
    plan_size: int
    spec_size: int


@dataclass(frozen=True)
class DpInvariantMismatch(Violation):
    kind = "consistency"
    code = "dp_invariant"
    plan_says: bool
    tables_say: bool


@dataclass(frozen=True)
class SpecHashMismatch(Violation):
    kind = "consistency"
    code = "spec_hash"


@dataclass(frozen=True)
class FieldDiffers(Violation):
    """A plan field that is not what the embedded spec compiles to."""

    kind = "consistency"
    code = "field_differs"
    field: str


# -- 11: encoder ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderLoraSkipped(Violation):
    kind = "encoder_lora"
    code = "encoder_lora_skipped"
    budgets: tuple[int, ...]


# -- tiers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnchorDeferred(Violation):
    """The largest graph of its mode and LoRA case is deferred: nothing to fall back on."""

    kind = "tiers"
    code = "anchor_deferred"
    graph: Descriptor


@dataclass(frozen=True)
class FallbackLoop(Violation):
    kind = "tiers"
    code = "fallback_loop"
    graph: Descriptor


@dataclass(frozen=True)
class FallbackCannotReplay(Violation):
    kind = "tiers"
    code = "fallback_cannot_replay"
    graph: Descriptor
    fallback: Descriptor


# -- eager regions: batches no captured graph can hold (reported, not violations) ----------------


AnyViolation = (
    GraphMisplaced
    | MalformedRange
    | CandidateCannotHold
    | RangesOverlap
    | DummyLayoutMismatch
    | DummyMaxQueryLen
    | KernelGridMismatch
    | TiersMalformed
    | CoverageHole
    | DummyTooLong
    | DummyRunTooLong
    | PiledRemainder
    | LoraOffGraphCarriesLora
    | NoLoraGraphWarmed
    | WrongAdapterCount
    | BadAdapterIds
    | KernelsShortCircuit
    | ShortKernelGrid
    | ShortFallbackGrid
    | DpDisagreement
    | DpMoreDisagreements
    | DpSizeMismatch
    | DpInvariantMismatch
    | SpecHashMismatch
    | FieldDiffers
    | EncoderLoraSkipped
    | AnchorDeferred
    | FallbackLoop
    | FallbackCannotReplay
)
"""Every kind of violation: a closed union, so that a renderer that `match`es on it with
`assert_never` is told by the type checker which one it does not handle."""


@dataclass(frozen=True)
class EagerRegion:
    """Batches of a kind (more than `served` requests; 0: any) that run eager in these LoRA
    cases because no captured graph can hold them."""

    code: ClassVar[str] = "eager_region"
    batch_kind: BatchKind
    served: int
    lora_cases: tuple[int, ...]
    every_case: bool
    token_runs: tuple[Span, ...]

    @property
    def token_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.token_runs)


@dataclass(frozen=True)
class AboveLargestGraph:
    """Every batch of lo..hi tokens runs eager: above the largest graph."""

    code: ClassVar[str] = "above_largest_graph"
    lo: int
    hi: int


Eager = EagerRegion | AboveLargestGraph


@dataclass
class VerifyReport:
    violations: list[AnyViolation] = field(default_factory=list)
    eager_regions: list[Eager] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, violation: AnyViolation) -> None:
        self.violations.append(violation)


def _cap(d: Descriptor) -> float:
    return float("inf") if d.num_reqs is None else d.num_reqs


class _Tables:
    """The plan's dispatch ranges per LoRA case, checked for structural sanity."""

    def __init__(self, plan: Plan, report: VerifyReport) -> None:
        self.descs = plan.descriptors
        self.rows: dict[int, list] = {}
        self.los: dict[int, list[int]] = {}  # each case's rows' lo, for bisect
        n = len(self.descs)
        for g_index, graph in enumerate(plan.graphs):
            if graph.id != g_index:
                report.add(GraphMisplaced(graph.id, g_index))
        for row in plan.dispatch:
            bad = [i for i in row.candidates if not 0 <= i < n]
            if bad or row.lo > row.hi:
                report.add(MalformedRange(row.lora_case, row.lo, row.hi, tuple(bad)))
                continue
            for i in row.candidates:
                d = self.descs[i]
                if d.num_active_loras != row.lora_case or d.num_tokens < row.hi:
                    report.add(CandidateCannotHold(row.lora_case, row.lo, row.hi, d))
            self.rows.setdefault(row.lora_case, []).append(row)
        for case, rows in self.rows.items():
            rows.sort(key=lambda r: r.lo)
            self.los[case] = [r.lo for r in rows]
            for a, b in zip(rows, rows[1:]):
                if b.lo <= a.hi:
                    report.add(RangesOverlap(case, (a.lo, a.hi), (b.lo, b.hi)))

    def row_at(self, case: int, tokens: int):
        rows = self.rows.get(case, [])
        i = bisect.bisect_right(self.los.get(case, []), tokens) - 1
        if i >= 0 and rows[i].lo <= tokens <= rows[i].hi:
            return rows[i]
        return None

    def candidates(self, case: int, tokens: int) -> list[Descriptor]:
        row = self.row_at(case, tokens)
        return [] if row is None else [self.descs[i] for i in row.candidates]


def _serves(d: Descriptor, uniform: int | None, reqs: int) -> bool:
    return compatible(d, reqs, uniform, None)


def _padded(tables: _Tables, case: int, tokens: int, uniform: int | None, reqs: int) -> int:
    for d in tables.candidates(case, tokens):
        if _serves(d, uniform, reqs):
            return d.num_tokens
    return tokens  # eager: no padding


def _check_coverage(plan: Plan, tables: _Tables, report: VerifyReport) -> None:
    spec = plan.spec
    seqs, budget, dql = spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens, plan.decode_query_len
    top = max((d.num_tokens for d in tables.descs), default=0)
    kinds = [("mixed", None), ("uniform-decode", dql)]
    # (hole?, kind, served, could-mode) -> case -> merged token spans
    found: dict[tuple, dict[int, list[list[int]]]] = {}
    for case in plan.lora_capture_cases:
        graphs = sorted((d for d in tables.descs if d.num_active_loras == case), key=lambda d: d.num_tokens)
        edges = sorted(
            {1, top + 1} | {r.lo for r in tables.rows.get(case, [])} | {r.hi + 1 for r in tables.rows.get(case, [])}
        )
        for lo, nxt in zip(edges, edges[1:]):
            hi = min(nxt - 1, budget)
            if lo > hi:
                continue
            cands = tables.candidates(case, lo)
            for kind, uniform in kinds:
                # Largest request count any batch of this kind and range can have.
                if uniform is None:
                    first_t, worst_r = lo, min(hi, seqs)
                else:
                    first_t = -(-lo // dql) * dql
                    if first_t > hi:
                        continue
                    worst_r = min(hi // dql, seqs)
                served = max((_cap(d) for d in cands if _serves(d, uniform, 1)), default=0)
                if served >= worst_r:
                    continue
                eager_r = int(served) + 1
                t = max(first_t, eager_r * (dql if uniform else 1))
                if t > hi:
                    continue
                could = next((d for d in graphs if d.num_tokens >= t and _serves(d, uniform, eager_r)), None)
                key = (could is not None, kind, int(served), could.cg_mode if could else "")
                spans = found.setdefault(key, {}).setdefault(case, [])
                if spans and spans[-1][1] + 1 >= t:
                    spans[-1][1] = hi
                else:
                    spans.append([t, hi])
    all_cases = list(plan.lora_capture_cases)
    for (hole, kind, served, mode), by_case in sorted(found.items()):
        groups: dict[tuple[Span, ...], list[int]] = {}
        for case, spans in by_case.items():
            groups.setdefault(tuple((lo, hi) for lo, hi in spans), []).append(case)
        for shared, cases in groups.items():
            every = len(all_cases) > 1 and cases == all_cases
            batch_kind: BatchKind = "mixed" if kind == "mixed" else "uniform-decode"
            if hole:
                report.add(CoverageHole(batch_kind, served, tuple(cases), every, shared, mode))
            else:
                report.eager_regions.append(EagerRegion(batch_kind, served, tuple(cases), every, shared))
    if top < budget:
        report.eager_regions.append(AboveLargestGraph(top + 1, budget))
    report.checked["dispatch_ranges"] = len(plan.dispatch)


def _check_encoder(plan: Plan, report: VerifyReport) -> None:
    """Encoder graphs are captured with no tower LoRA mapping set: with specialize_active_lora
    the tower and connector LoRA kernels read an active-adapter count of 0 at capture, launch
    with an empty grid and are not in the graph; every replay then runs the base tower."""
    enc, mm = plan.encoder, plan.spec.multimodal
    if enc is None or mm is None:
        return
    report.checked["encoder graphs"] = len(enc.budgets)
    if enc.budgets and mm.tower_connector_lora and plan.spec.lora.specialize_active:
        report.add(EncoderLoraSkipped(tuple(enc.budgets)))


def _check_graphs(plan: Plan, report: VerifyReport) -> None:
    spec = plan.spec
    lora = spec.lora
    seqs, model_len = spec.scheduler.max_num_seqs, spec.scheduler.max_model_len
    slots_needed = slots_by_case(plan.spec, plan.lora_dispatch_key == "kernel_slots", plan.lora_dispatch_map)
    short_grids: dict[tuple, list[Descriptor]] = {}
    piled: list[tuple[Descriptor, int, int]] = []
    for g in plan.graphs:
        d, dummy = g.descriptor, g.dummy
        reqs = d.num_reqs or min(d.num_tokens, seqs)
        tokens = [t for count, t in dummy.tokens for _ in range(count)]
        if dummy.num_reqs != reqs or len(tokens) != reqs or sum(tokens) != d.num_tokens or min(tokens, default=0) < 1:
            report.add(DummyLayoutMismatch(d, len(tokens), sum(tokens), reqs, d.num_tokens))
            continue
        longest = max(tokens)
        if dummy.max_query_len != longest:
            report.add(DummyMaxQueryLen(d, dummy.max_query_len, longest))
        even = -(-d.num_tokens // reqs)
        if longest > model_len:
            report.add(DummyTooLong(d, longest, "max_model_len", model_len))
        elif longest > even:
            piled.append((d, longest, even))
        if d.max_query_len is not None and longest > d.max_query_len:
            report.add(DummyTooLong(d, longest, "max_query_len", d.max_query_len))
        if not lora.enabled:
            if dummy.lora_ids is not None or d.num_active_loras:
                report.add(LoraOffGraphCarriesLora(d))
            continue
        ids = dummy.lora_ids or []
        rows = set(ids[:reqs])  # the ids the dummy requests get, cycled
        if not rows or any(i != -1 and not 1 <= i <= lora.max_loras for i in ids):
            report.add(BadAdapterIds(d, tuple(ids), lora.max_loras))
            continue
        real = {i for i in rows if i != -1}
        if d.num_active_loras == 0:
            if real:
                report.add(NoLoraGraphWarmed(d, tuple(sorted(real))))
        elif not real:
            report.add(KernelsShortCircuit(d))
            continue
        elif len(real) != min(d.num_active_loras, lora.max_loras, reqs):
            report.add(WrongAdapterCount(d, len(real), min(d.num_active_loras, lora.max_loras, reqs)))
        grid = kernel_grid(ids, reqs, spec)
        if dummy.kernel_grid != grid:
            report.add(KernelGridMismatch(d, dummy.kernel_grid, grid))
        need = slots_needed.get(d.num_active_loras, [])
        idx = bisect.bisect_right([s for s, _ in need], reqs) - 1
        if idx >= 0 and need[idx][0] > grid:
            slots, example = need[idx]
            short_grids.setdefault((d.num_active_loras, grid, slots, example), []).append(d)
    for (case, grid, slots, example), descs in sorted(short_grids.items()):
        report.add(ShortKernelGrid(case, tuple(descs), grid, slots, example))
    for run in plan.dummy_runs:
        if run.longest > model_len:
            fix: Literal["max_capture_size", "dummy_remainder", "limits"] = (
                "max_capture_size"
                if run.run == "dp_idle"
                else "dummy_remainder"
                if run.vllm_longest == run.longest and not plan.spec.rules.spreads_dummy_remainder
                else "limits"
            )
            report.add(DummyRunTooLong(run.run, run.tokens, run.longest, model_len, fix))
    if piled:
        worst = max(piled, key=lambda p: p[1] - p[2])
        report.add(PiledRemainder(len(piled), *worst))
    report.checked["graphs"] = len(plan.graphs)


def _check_dp(plan: Plan, tables: _Tables, report: VerifyReport) -> None:
    spec = plan.spec
    size = spec.parallel.synced_size
    if plan.dp.data_parallel_size != size:
        report.add(DpSizeMismatch(plan.dp.data_parallel_size, size))
    dql, seqs = plan.decode_query_len, spec.scheduler.max_num_seqs
    cases = plan.lora_capture_cases
    points = sorted(
        {r.lo for rows in tables.rows.values() for r in rows} | {r.hi for rows in tables.rows.values() for r in rows}
    )
    disagreements = []
    lora_dependent = False
    memo: dict[int, set[int]] = {}

    def reachable(r: int) -> set[int]:
        if r not in memo:
            memo[r] = reachable_cases(spec, plan.lora_dispatch_map, r)
        return memo[r]

    for tokens in points:
        for uniform in (None, dql):
            if uniform is not None and tokens % dql:
                continue
            max_r = min(tokens, seqs) if uniform is None else min(tokens // dql, seqs)
            if max_r < 1:
                continue
            # Each rank re-dispatches the agreed count with its own requests and
            # LoRA case; only cases its requests can reach (plus, under DP, the
            # idle rank's dummy case) occur.
            padded = {
                (c, r): _padded(tables, c, tokens, uniform, r) for r in {1, max_r} for c in cases if c in reachable(r)
            }
            if len(set(padded.values())) > 1:
                disagreements.append((tokens, uniform, padded))
                if any(len({padded[(c, r)] for c in cases if c in reachable(r)}) > 1 for r in {1, max_r}):
                    lora_dependent = True
    invariant = not lora_dependent
    if plan.dp.padded_tokens_lora_invariant != invariant:
        report.add(DpInvariantMismatch(plan.dp.padded_tokens_lora_invariant, invariant))
    if size > 1:
        for tokens, uniform, padded in disagreements[:20]:
            kind: BatchKind = "mixed" if uniform is None else "uniform-decode"
            values = sorted(set(padded.values()))
            (c1, r1), (c2, r2) = (
                next(k for k, v in padded.items() if v == values[0]),
                next(k for k, v in padded.items() if v == values[-1]),
            )
            report.add(DpDisagreement(kind, tokens, c1, r1, values[0], c2, r2, values[-1]))
        if len(disagreements) > 20:
            report.add(DpMoreDisagreements(len(disagreements) - 20))
    report.checked["dp_points"] = len(points)


def _check_tiers(plan: Plan, report: VerifyReport) -> None:
    """Every intermediate state of deferred capture (any subset of the deferred graphs
    captured): a batch replays the first captured graph of its chain (tiers.chain), so every
    graph of every chain must replay all of the deferred graph's batches, LoRA grid
    included (failure class 6), and every chain must end in a ready graph."""
    tiers = plan.tiers
    if tiers is None:
        return
    from capplan.planner.tiers import StandIns, anchors, can_stand_in, chain, needed_slots

    n = len(plan.graphs)
    deferred = set(tiers.deferred)
    if len(deferred) != len(tiers.deferred) or not deferred <= set(range(n)):
        report.add(TiersMalformed("deferred"))
        return
    if set(tiers.fallback) != deferred or not set(tiers.fallback.values()) <= set(range(n)):
        report.add(TiersMalformed("fallback"))
        return
    needs_by_case = slots_by_case(plan.spec, plan.lora_dispatch_key == "kernel_slots", plan.lora_dispatch_map)
    lora_on = plan.spec.lora.enabled
    for a in sorted(anchors(plan.graphs) & deferred):
        report.add(AnchorDeferred(plan.descriptors[a]))
    short: dict[tuple[int, int], list[tuple[Descriptor, Descriptor]]] = {}
    states = 0
    # Every graph after G in G's chain must replay G's batches. The rest of G's chain is the
    # chain of G's fallback, so what its graphs share (StandIns) is summed once per graph and
    # G is judged against the whole of it at once; a chain that fails is walked graph by graph
    # below, to name each graph that cannot stand in.
    rests: dict[int, tuple[int, StandIns] | None] = {}  # deferred graph -> (length, shared); None: loops

    def rest_of(gid: int) -> tuple[int, StandIns] | None:
        path, on_path, x = [], set(), gid
        while x in deferred and x not in rests and x not in on_path:
            path.append(x)
            on_path.add(x)
            x = tiers.fallback[x]
        acc = None if x in on_path else rests.get(x, (0, None))  # type: ignore[arg-type]
        for p in reversed(path):
            if acc is not None:
                f = plan.graphs[tiers.fallback[p]]
                one = StandIns.of(f.descriptor, f.dummy.kernel_grid if lora_on else None)
                acc = (acc[0] + 1, one if acc[1] is None else one + acc[1])
            rests[p] = acc
        return rests[gid]

    for gid in tiers.deferred:
        g = plan.graphs[gid]
        rest = rest_of(gid)
        if rest is None:
            report.add(FallbackLoop(g.descriptor))
            continue
        needs = needed_slots(needs_by_case, g.descriptor, plan.spec) if lora_on else 0
        if lora_on and g.dummy.kernel_grid is not None:
            # A graph that under-provisions itself is reported above (its own class 6); its
            # fallbacks must cover what it covers, and every slot when it covers them all.
            needs = min(needs, g.dummy.kernel_grid)
        states += rest[0]
        if rest[1].replay(g.descriptor, needs):
            continue
        for fid in chain(tiers, gid, deferred)[1:]:
            f = plan.graphs[fid]
            grid = f.dummy.kernel_grid if lora_on else None
            if can_stand_in(f.descriptor, g.descriptor, grid, needs):
                continue
            if can_stand_in(f.descriptor, g.descriptor, None if grid is None else 1 << 30, 0):
                short.setdefault((needs, grid or 0), []).append((g.descriptor, f.descriptor))
            else:
                report.add(FallbackCannotReplay(g.descriptor, f.descriptor))
    for (needs, grid), pairs in sorted(short.items()):
        report.add(ShortFallbackGrid(grid, needs, tuple(pairs)))
    report.checked["deferred_fallbacks"] = states


def _check_consistency(plan: Plan, report: VerifyReport) -> None:
    from capplan.planner.compiler import compile_plan
    from capplan.planner.hashing import spec_hash

    if plan.spec_hash != spec_hash(plan.spec):
        report.add(SpecHashMismatch())
    expected = compile_plan(plan.spec)
    for name in type(plan).model_fields:
        if getattr(expected, name) != getattr(plan, name):
            report.add(FieldDiffers(name))


def eager_records(plan: Plan) -> list[Eager]:
    """The batches no graph of the plan serves, as verify reports them (its coverage check
    alone: show and its picture need no other)."""
    report = VerifyReport()
    _check_coverage(plan, _Tables(plan, report), report)
    return report.eager_regions


def verify_plan(plan: Plan, *, consistency: bool = True) -> VerifyReport:
    report = VerifyReport()
    tables = _Tables(plan, report)
    _check_coverage(plan, tables, report)
    _check_graphs(plan, report)
    _check_dp(plan, tables, report)
    _check_encoder(plan, report)
    _check_tiers(plan, report)
    if consistency:
        _check_consistency(plan, report)
    return report
