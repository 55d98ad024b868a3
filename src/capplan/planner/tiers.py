"""Capture tiers: which graphs are ready before the engine serves, which are deferred, and
what a deferred graph's batches replay until it is captured.

A deferred graph G falls back to the next larger graph of its mode, decode shape
(uniform token count, max_query_len bound) and LoRA case; if that one is deferred too and
not captured yet, to its fallback, and so on. The largest graph of each mode, decode shape
and LoRA case is always ready, so every chain ends in a ready graph: no batch that has a
graph in the final plan ever runs eager, and vLLM's FULL output buffer (sized by the first
FULL graph it captures) is sized by the largest. `verify` proves, with `can_stand_in`, that
every graph of every chain replays all of G's batches (tokens, requests, decode shape, and
a kernel grid covering every adapter slot they bring: failure class 6), which is every
intermediate state: in any state the batch replays the first captured graph of its chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from capplan.schemas.plan import Descriptor, PlannedGraph, TierPlan, address
from capplan.schemas.spec import Spec

RULE_FULL_DECODE = "full_decode"


def shape(d: Descriptor) -> tuple[str, int | None, int | None]:
    """What a stand-in must share with the graph it replaces."""
    return (d.cg_mode, d.uniform_token_count, d.max_query_len)


def anchors(graphs: list[PlannedGraph]) -> set[int]:
    """The largest graph of each mode, decode shape and LoRA case: always ready."""
    best: dict[tuple[str, int | None, int | None, int], PlannedGraph] = {}
    for g in graphs:
        key = (*shape(g.descriptor), g.descriptor.num_active_loras)
        top = best.get(key)
        if top is None or g.descriptor.num_tokens > top.descriptor.num_tokens:
            best[key] = g
    return {g.id for g in best.values()}


def specialization(n: int) -> str:
    """Triton's default `specialize` of an integer argument: equal to 1, a multiple of 16, or
    neither. A kernel is compiled once per specialization of its arguments."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "other"


def kernel_class(n: int | None) -> tuple[str, bool] | None:
    """How the kernels a graph runs are compiled for a size (tokens, or requests): its Triton
    `specialization`, and whether it is below 128, where vLLM's default LoRA shrink config
    switches its block sizes (`get_lora_op_configs`, every release)."""
    if n is None:
        return None
    return (specialization(n), n < 128)


def warm_set(graphs: list[PlannedGraph]) -> set[int]:
    """The largest graph of each kernel class (`kernel_class` of its tokens and requests) in each
    mode, decode shape and LoRA case: ready, so that a deferred capture never waits on a kernel
    compile (the first capture of a new class, measured on the H200: 0.9-5.3 s; the others
    8-20 ms). A performance rule only: no batch depends on it, and `verify` does not check it."""
    best: dict[tuple[object, ...], PlannedGraph] = {}
    for g in graphs:
        d = g.descriptor
        key = (*shape(d), d.num_active_loras, kernel_class(d.num_tokens), kernel_class(d.num_reqs))
        top = best.get(key)
        if top is None or d.num_tokens > top.descriptor.num_tokens:
            best[key] = g
    return {g.id for g in best.values()}


SPLIT_KV_MAX_QUERY_LEN = 8  # vLLM 0.33.0's MAX_3D_QUERY_LEN: longer queries run the 2D kernel


def attention_queries(g: PlannedGraph) -> tuple[int, ...]:
    """The longest query (max_seqlen_q) the attention of a graph's capture may see: its dummy
    batch's, and for a FULL graph of mixed batches also its token count, which vLLM 0.31.0 on
    passes as max_query_len (such a graph may replay one prefill spanning the batch)."""
    d = g.descriptor
    if d.cg_mode == "FULL" and d.uniform_token_count is None:
        return tuple(sorted({g.dummy.max_query_len, d.num_tokens}))
    return (g.dummy.max_query_len,)


def attention_warm(
    graphs: list[PlannedGraph], ready: set[int], max_num_seqs: int, thresholds: Sequence[int]
) -> set[int]:
    """The graphs to make ready beyond `ready` so that no deferred capture is the first to
    compile an attention kernel, where the attention backend switches kernels on the batch
    (a fact of the running engine, not of the spec): vLLM's Triton unified attention
    (TRITON_ATTN) runs its split-KV (3D) kernel, and a segment-reduce kernel after it, for a
    batch of at most `seq_threshold_3D` one-token requests (0.25.0-0.32.0), or (0.33.0) for a
    causal batch whose longest query is at most 8 tokens and whose requests times query blocks
    (the longest query over BLOCK_Q, which depends on the model's heads) are at most the
    threshold, with no more tokens than the split-KV scratch holds (min(threshold,
    max_num_seqs) rows without speculative decoding); the 2D kernel otherwise. Each is
    compiled per Triton `specialization` of its integer arguments. `thresholds`: each
    attention group's `seq_threshold_3D` (none: no such switch, nothing to add).

    A class is what decides the kernel and its compile whatever BLOCK_Q is: mode and decode
    shape, the capture's longest queries (`attention_queries`; each up to 8 itself, a longer
    one by its specialization), for each threshold whether the requests times each block
    count the longest query could make (1 up to that query) fit, and whether the tokens fit
    the scratch, and the specializations of tokens and requests. For every class no ready
    graph is in, its largest graph. A conservative rule: PIECEWISE captures of 0.25.x run no
    attention, and the 0.33.0 terms split classes on older releases, so some graphs are made
    ready for nothing. On the H200 (vLLM 0.33.0, 2-layer Llama, 2 KV heads: threshold 64)
    the first capture on the 3D side with 64 requests took 0.80 s, 0.58 s of it compiling
    `kernel_unified_attention` and 0.20 s `reduce_segments`. A performance rule, like
    `warm_set`: every subset of captured graphs is a state `verify` proves."""
    if not thresholds:
        return set()

    def key(g: PlannedGraph) -> tuple[object, ...]:
        d, reqs = g.descriptor, g.dummy.num_reqs
        queries = attention_queries(g)
        longest = max([q for q in queries if q <= SPLIT_KV_MAX_QUERY_LEN], default=1)  # blocks it can make
        fits = tuple(
            (reqs * blocks <= t, d.num_tokens <= min(t, max_num_seqs))
            for t in sorted(thresholds)
            for blocks in range(1, longest + 1)
        )
        lengths = tuple(q if q <= SPLIT_KV_MAX_QUERY_LEN else ("long", specialization(q)) for q in queries)
        return (*shape(d), lengths, fits, specialization(d.num_tokens), specialization(reqs))

    covered = {key(graphs[gid]) for gid in ready}
    best: dict[tuple[object, ...], PlannedGraph] = {}
    for g in graphs:
        k = key(g)
        if k in covered:
            continue
        top = best.get(k)
        if top is None or g.descriptor.num_tokens > top.descriptor.num_tokens:
            best[k] = g
    return {g.id for g in best.values()}


def across_cases(d: Descriptor) -> tuple[str, int, int | None, int | None, int | None]:
    """A graph's size and shape without its LoRA case: what DP ranks that pad to one another must
    replay alike, each with its own LoRA count."""
    return (d.cg_mode, d.num_tokens, d.num_reqs, d.uniform_token_count, d.max_query_len)


def case_groups(graphs: list[PlannedGraph], ids: list[int]) -> list[list[int]]:
    """`ids` (in their order) grouped by `across_cases`, each group where its first graph is:
    the graphs DP ranks capture together, so that at every step either every LoRA case of a size
    and shape is captured or none is, and every rank's fallback for the DP-agreed batch is a
    graph of one size."""
    groups: dict[tuple[str, int, int | None, int | None, int | None], list[int]] = {}
    for gid in ids:
        groups.setdefault(across_cases(graphs[gid].descriptor), []).append(gid)
    return list(groups.values())


def chosen_ready(spec: Spec, graphs: list[PlannedGraph]) -> set[int]:
    """The graph ids the spec names ready (before anchors are added); raises ValueError naming
    an address that is not a graph of the plan."""
    assert spec.tiers is not None
    ready = spec.tiers.ready
    if ready == RULE_FULL_DECODE:
        return {g.id for g in graphs if g.descriptor.cg_mode == "FULL" and g.descriptor.uniform_token_count is not None}
    by_address = {address(g.descriptor): g.id for g in graphs}
    missing = [(i, a) for i, a in enumerate(ready) if a not in by_address]
    if missing:
        i, a = missing[0]
        raise ValueError(f"tiers.ready[{i}]: {a} is not a graph of this plan")
    return {by_address[a] for a in ready}


def unknown_ready(spec: Spec, graphs: list[PlannedGraph]) -> str | None:
    """Why the spec's tiers.ready names a graph the plan does not have, or None."""
    if spec.tiers is None:
        return None
    try:
        chosen_ready(spec, graphs)
    except ValueError as exc:
        return f"{exc}; name graphs of this plan (capplan show PLAN --full lists their addresses)"
    return None


@dataclass(frozen=True)
class StandIns:
    """What one or more stand-in graphs share, as far as replaying another graph's batches
    goes: the one rule `can_stand_in` applies to a single graph, and `verify` to a whole
    chain at once (every graph of the chain must replay the deferred graph's batches)."""

    shapes: frozenset[tuple[str, int | None, int | None]]
    min_tokens: int
    reqs_none: bool  # every stand-in runs any request count (PIECEWISE)
    min_reqs: int | None  # the fewest requests a request-padding stand-in holds (None: none pads)
    exact_cases: frozenset[int]  # LoRA cases of stand-ins matched by case (LoRA off: no kernel grid)
    min_grid: int | None  # the smallest captured kernel grid among the others (None: none has one)
    grid_without_lora: bool  # one of those recorded no LoRA kernels (case 0)

    @classmethod
    def of(cls, f: Descriptor, f_grid: int | None) -> StandIns:
        """One stand-in: graph f, with its captured kernel grid (None: LoRA off)."""
        return cls(
            shapes=frozenset({shape(f)}),
            min_tokens=f.num_tokens,
            reqs_none=f.num_reqs is None,
            min_reqs=f.num_reqs,
            exact_cases=frozenset({f.num_active_loras}) if f_grid is None else frozenset(),
            min_grid=f_grid,
            grid_without_lora=f_grid is not None and not f.num_active_loras,
        )

    def __add__(self, other: StandIns) -> StandIns:
        def least(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)

        return StandIns(
            shapes=self.shapes | other.shapes,
            min_tokens=min(self.min_tokens, other.min_tokens),
            reqs_none=self.reqs_none and other.reqs_none,
            min_reqs=least(self.min_reqs, other.min_reqs),
            exact_cases=self.exact_cases | other.exact_cases,
            min_grid=least(self.min_grid, other.min_grid),
            grid_without_lora=self.grid_without_lora or other.grid_without_lora,
        )

    def replay(self, g: Descriptor, needs: int) -> bool:
        """Whether every stand-in replays every batch graph g replays; `needs`: the most adapter
        slots such a batch can bring."""
        if self.shapes != {shape(g)} or self.min_tokens < g.num_tokens:
            return False
        if g.num_reqs is None:
            if not self.reqs_none:
                return False  # a request-padding graph cannot replay a graph of any request count
        elif self.min_reqs is not None and self.min_reqs < g.num_reqs:
            return False
        if self.exact_cases - {g.num_active_loras}:
            return False
        if self.min_grid is not None:
            if g.num_active_loras and self.grid_without_lora:
                return False  # a no-LoRA graph recorded no LoRA kernels
            if self.min_grid < needs:
                return False
        return True


def can_stand_in(f: Descriptor, g: Descriptor, f_grid: int | None, needs: int) -> bool:
    """Whether graph f replays every batch graph g replays. `f_grid`: f's captured kernel grid
    (None: LoRA off); `needs`: the most adapter slots a batch g replays can bring."""
    return StandIns.of(f, f_grid).replay(g, needs)


def tier_plan(spec: Spec, graphs: list[PlannedGraph]) -> TierPlan:
    """The plan's tiers: ready graphs (the spec's choice, the anchors and the warm set; with DP
    ranks that pad to one another, every LoRA case of their sizes), the deferred ones in capture
    order, and each deferred graph's fallback."""
    assert spec.tiers is not None
    ready = chosen_ready(spec, graphs) | anchors(graphs) | warm_set(graphs)
    if spec.parallel.synced_size > 1:  # DP ranks pad to one another: every LoRA case of a ready size is ready
        sizes = {across_cases(graphs[gid].descriptor) for gid in ready}
        ready |= {g.id for g in graphs if across_cases(g.descriptor) in sizes}
    deferred = [g.id for g in graphs if g.id not in ready]
    by_key: dict[tuple[str, int | None, int | None, int], list[PlannedGraph]] = {}
    for g in graphs:
        by_key.setdefault((*shape(g.descriptor), g.descriptor.num_active_loras), []).append(g)
    fallback: dict[int, int] = {}
    for group in by_key.values():
        group.sort(key=lambda g: g.descriptor.num_tokens)
        for smaller, larger in zip(group, group[1:]):
            if smaller.id not in ready:
                fallback[smaller.id] = larger.id
    return TierPlan.trusted(
        deferred=deferred, fallback={gid: fallback[gid] for gid in deferred}, every_steps=spec.tiers.every_steps
    )


def chain(tiers: TierPlan, graph_id: int, deferred: set[int] | frozenset[int] | None = None) -> list[int]:
    """What a batch of `graph_id` may replay, in order, as deferred graphs land: the graph,
    then its fallbacks up to the first that is not deferred (stops on a loop or a dangling id).
    `deferred`: set(tiers.deferred), when the caller has it."""
    if deferred is None:
        deferred = set(tiers.deferred)
    out, seen = [graph_id], {graph_id}
    while out[-1] in deferred and out[-1] in tiers.fallback and tiers.fallback[out[-1]] not in seen:
        out.append(tiers.fallback[out[-1]])
        seen.add(out[-1])
    return out


def needed_slots(slots_needed: dict[int, list[tuple[int, str]]], g: Descriptor, spec: Spec) -> int:
    """The most adapter slots a batch replaying g can bring (0 when LoRA is off or g's case is 0)."""
    import bisect

    need = slots_needed.get(g.num_active_loras, [])
    reqs = g.num_reqs or min(g.num_tokens, spec.scheduler.max_num_seqs)
    i = bisect.bisect_right([s for s, _ in need], reqs) - 1
    return need[i][0] if i >= 0 else 0


def replayed(tiers: TierPlan, graph_id: int, captured: set[int] | frozenset[int]) -> int:
    """The graph a batch dispatched to `graph_id` replays while only `captured` exist: the first
    captured graph of its chain, or -1 (eager) when none is."""
    for gid in chain(tiers, graph_id):
        if gid in captured:
            return gid
    return -1
