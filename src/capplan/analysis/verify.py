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

from capplan.planner.dispatch import compatible
from capplan.planner.lora_cases import kernel_grid, reachable_cases, slots_by_case
from capplan.schemas.plan import Descriptor, Plan, address

CLASSES = {
    "structure": "plan tables reference graphs that cannot serve them",
    "coverage": "8: coverage hole",
    "lora_kernels": "1: LoRA kernels missing from a graph",
    "lora_ids": "2: LoRA graph warmed without a valid adapter mapping",
    "lora_case": "3: graph warmed with the wrong active-LoRA count",
    "lora_grid": "6: no-LoRA slot not counted",
    "dummy_length": "5: dummy request too long",
    "dp": "7: DP ranks can disagree",
    "encoder_lora": "11: encoder graphs skip tower/connector LoRA",
    "tiers": "deferred capture: a state where a batch has no valid graph",
    "consistency": "hand edit: plan does not match its spec",
}


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str

    def line(self) -> str:
        return f"[{self.kind}] {self.message}"


@dataclass
class VerifyReport:
    violations: list[Violation] = field(default_factory=list)
    eager_regions: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, kind: str, message: str) -> None:
        self.violations.append(Violation(kind, message))

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "violations": [
                {"kind": v.kind, "failure_class": CLASSES[v.kind], "message": v.message} for v in self.violations
            ],
            "eager_regions": self.eager_regions,
            "checked": self.checked,
        }


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
                report.add("structure", f"graph #{graph.id} is listed at position {g_index}")
        for row in plan.dispatch:
            bad = [i for i in row.candidates if not 0 <= i < n]
            if bad or row.lo > row.hi:
                report.add(
                    "structure",
                    f"dispatch range case {row.lora_case} tokens {row.lo}..{row.hi} "
                    f"is malformed (unknown graph ids {bad})"
                    if bad
                    else f"dispatch range case {row.lora_case} has lo {row.lo} > hi {row.hi}",
                )
                continue
            for i in row.candidates:
                d = self.descs[i]
                if d.num_active_loras != row.lora_case or d.num_tokens < row.hi:
                    report.add(
                        "structure",
                        f"case {row.lora_case} tokens {row.lo}..{row.hi} lists graph "
                        f"{address(d)} that cannot hold them",
                    )
            self.rows.setdefault(row.lora_case, []).append(row)
        for case, rows in self.rows.items():
            rows.sort(key=lambda r: r.lo)
            self.los[case] = [r.lo for r in rows]
            for a, b in zip(rows, rows[1:]):
                if b.lo <= a.hi:
                    report.add("structure", f"case {case}: dispatch ranges {a.lo}..{a.hi} and {b.lo}..{b.hi} overlap")

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


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}..{hi}"


def _cases(cases: list[int], all_cases: list[int]) -> str:
    if len(all_cases) > 1 and cases == all_cases:
        return "all LoRA cases"
    return ("LoRA case " if len(cases) == 1 else "LoRA cases ") + ", ".join(map(str, cases))


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
        groups: dict[tuple, list[int]] = {}
        for case, spans in by_case.items():
            groups.setdefault(tuple(map(tuple, spans)), []).append(case)
        for shared, cases in groups.items():
            spans = [list(span) for span in shared]
            count = sum(hi - lo + 1 for lo, hi in spans)
            listed = ", ".join(_span(lo, hi) for lo, hi in spans[:8]) + (", ..." if len(spans) > 8 else "")
            who = f"{kind} batches" + (f" of more than {served} requests" if served else "")
            where = f"{_cases(cases, all_cases)}: {who}, {count} token count(s) ({listed})"
            if hole:
                report.add("coverage", f"{where} run eager although a captured {mode} graph could serve them")
            else:
                report.eager_regions.append(f"{where} run eager (no captured graph can hold them)")
    if top < budget:
        report.eager_regions.append(f"all batches of {top + 1}..{budget} tokens run eager (above the largest graph)")
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
        report.add(
            "encoder_lora",
            f"{len(enc.budgets)} encoder graph(s) {', '.join(f'ENCODER:{b}' for b in enc.budgets)} are captured "
            "with tower/connector LoRA on and specialize_active_lora: the LoRA kernels launch with 0 active "
            "adapters at capture, so vision requests with an adapter get base-tower outputs (fix: encoder_lora_eager)",
        )


def _check_graphs(plan: Plan, report: VerifyReport) -> None:
    spec = plan.spec
    lora = spec.lora
    seqs, model_len = spec.scheduler.max_num_seqs, spec.scheduler.max_model_len
    slots_needed = slots_by_case(plan.spec, plan.lora_dispatch_key == "kernel_slots", plan.lora_dispatch_map)
    short_grids: dict[tuple, list[Descriptor]] = {}
    piled: list[tuple[str, int, int]] = []
    for g in plan.graphs:
        d, dummy = g.descriptor, g.dummy
        name = f"graph {address(d)}"
        reqs = d.num_reqs or min(d.num_tokens, seqs)
        tokens = [t for count, t in dummy.tokens for _ in range(count)]
        if dummy.num_reqs != reqs or len(tokens) != reqs or sum(tokens) != d.num_tokens or min(tokens, default=0) < 1:
            report.add(
                "structure",
                f"{name}: dummy layout of {len(tokens)} requests / {sum(tokens)} tokens "
                f"does not capture {reqs} requests / {d.num_tokens} tokens",
            )
            continue
        longest = max(tokens)
        if dummy.max_query_len != longest:
            report.add("structure", f"{name}: dummy max_query_len {dummy.max_query_len} != longest request {longest}")
        even = -(-d.num_tokens // reqs)
        if longest > model_len:
            report.add("dummy_length", f"{name}: dummy request of {longest} tokens exceeds max_model_len {model_len}")
        elif longest > even:
            piled.append((address(d), longest, even))
        if d.max_query_len is not None and longest > d.max_query_len:
            report.add("dummy_length", f"{name}: dummy request of {longest} tokens exceeds the graph's max_query_len")
        if not lora.enabled:
            if dummy.lora_ids is not None or d.num_active_loras:
                report.add("lora_case", f"{name}: LoRA is off but the graph carries a LoRA case or dummy adapters")
            continue
        ids = dummy.lora_ids or []
        rows = set(ids[:reqs])  # the ids the dummy requests get, cycled
        if not rows or any(i != -1 and not 1 <= i <= lora.max_loras for i in ids):
            report.add("lora_ids", f"{name}: dummy adapter ids {ids} are not -1 or 1..{lora.max_loras}")
            continue
        real = {i for i in rows if i != -1}
        if d.num_active_loras == 0:
            if real:
                report.add("lora_case", f"{name}: a no-LoRA graph is warmed with adapters {sorted(real)}")
        elif not real:
            report.add(
                "lora_kernels",
                f"{name}: every dummy request is -1, so the LoRA kernels "
                "short-circuit and are not recorded in the graph",
            )
            continue
        elif len(real) != min(d.num_active_loras, lora.max_loras, reqs):
            report.add(
                "lora_case",
                f"{name}: warmed with {len(real)} adapters, the case needs "
                f"{min(d.num_active_loras, lora.max_loras, reqs)}",
            )
        grid = kernel_grid(ids, reqs, spec)
        if dummy.kernel_grid != grid:
            report.add("structure", f"{name}: kernel_grid {dummy.kernel_grid} does not follow from its dummy ({grid})")
        need = slots_needed.get(d.num_active_loras, [])
        idx = bisect.bisect_right([s for s, _ in need], reqs) - 1
        if idx >= 0 and need[idx][0] > grid:
            slots, example = need[idx]
            short_grids.setdefault((d.num_active_loras, grid, slots, example), []).append(d)
    for (case, grid, slots, example), descs in sorted(short_grids.items()):
        report.add(
            "lora_grid",
            f"LoRA case {case}: {len(descs)} graph(s) ({_sample(descs)}) record a kernel grid "
            f"of {grid} but serve {example} ({slots} kernel slots): an adapter is skipped",
        )
    for run in plan.dummy_runs:
        if run.longest > model_len:
            fix = (
                "a one-request batch: no remainder fix shortens it; keep the largest PIECEWISE graph "
                f"(cudagraph.max_capture_size) at most {model_len}"
                if run.run == "dp_idle"
                else "turn on the dummy_remainder fix"
                if run.vllm_longest == run.longest and not plan.spec.rules.spreads_dummy_remainder
                else "raise max_num_seqs or max_model_len"
            )
            report.add(
                "dummy_length",
                f"{run.run} dummy run of {run.tokens} tokens: a request of {run.longest} "
                f"tokens exceeds max_model_len {model_len} ({fix})",
            )
    if piled:
        worst = max(piled, key=lambda p: p[1] - p[2])
        report.add(
            "dummy_length",
            f"{len(piled)} dummy batch(es) pile the token remainder on one request "
            f"(worst: graph {worst[0]}, {worst[1]} tokens where an even split needs {worst[2]})",
        )
    report.checked["graphs"] = len(plan.graphs)


def _sample(descs: list[Descriptor]) -> str:
    labels = [address(d) for d in descs[:4]]
    return ", ".join(labels) + (", ..." if len(descs) > 4 else "")


def _check_dp(plan: Plan, tables: _Tables, report: VerifyReport) -> None:
    spec = plan.spec
    size = spec.parallel.synced_size
    if plan.dp.data_parallel_size != size:
        report.add("consistency", f"dp.data_parallel_size {plan.dp.data_parallel_size} != spec {size}")
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
        report.add(
            "consistency",
            f"dp.padded_tokens_lora_invariant says {plan.dp.padded_tokens_lora_invariant}, the tables say {invariant}",
        )
    if size > 1:
        for tokens, uniform, padded in disagreements[:20]:
            kind = "mixed" if uniform is None else "uniform-decode"
            values = sorted(set(padded.values()))
            (c1, r1), (c2, r2) = (
                next(k for k, v in padded.items() if v == values[0]),
                next(k for k, v in padded.items() if v == values[-1]),
            )
            side = lambda v, tokens=tokens: "runs eager" if v == tokens else f"pads to {v}"
            report.add(
                "dp",
                f"an agreed {kind} batch of {tokens} tokens {side(values[0])} on a rank with LoRA "
                f"case {c1} and {r1} request(s) but {side(values[-1])} on one with case {c2} "
                f"and {r2}",
            )
        if len(disagreements) > 20:
            report.add("dp", f"... and {len(disagreements) - 20} more token counts where DP ranks can disagree")
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
        report.add("structure", "tiers.deferred lists a graph twice or a graph the plan does not have")
        return
    if set(tiers.fallback) != deferred or not set(tiers.fallback.values()) <= set(range(n)):
        report.add("structure", "tiers.fallback does not name exactly one graph of the plan per deferred graph")
        return
    needs_by_case = slots_by_case(plan.spec, plan.lora_dispatch_key == "kernel_slots", plan.lora_dispatch_map)
    lora_on = plan.spec.lora.enabled
    for a in sorted(anchors(plan.graphs) & deferred):
        report.add(
            "tiers",
            f"graph {address(plan.descriptors[a])} is the largest of its mode and LoRA case but deferred: its "
            "batches have no captured graph to fall back on (and vLLM sizes the FULL output buffer by it)",
        )
    short: dict[tuple[int, int], list[str]] = {}
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
            report.add("tiers", f"graph {address(g.descriptor)}: its fallbacks loop or end in a deferred graph")
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
                short.setdefault((needs, grid or 0), []).append(f"{address(g.descriptor)} -> {address(f.descriptor)}")
            else:
                report.add(
                    "tiers",
                    f"graph {address(g.descriptor)} falls back to {address(f.descriptor)}, which cannot replay its "
                    "batches (mode, decode shape, tokens or requests)",
                )
    for (needs, grid), pairs in sorted(short.items()):
        report.add(
            "lora_grid",
            f"{len(pairs)} deferred graph(s) fall back to a graph whose kernel grid ({grid}) is smaller than the "
            f"{needs} adapter slots their batches bring ({', '.join(pairs[:3])}{', ...' if len(pairs) > 3 else ''}): "
            "until captured, an adapter is skipped",
        )
    report.checked["deferred_fallbacks"] = states


def _check_consistency(plan: Plan, report: VerifyReport) -> None:
    from capplan.planner.compiler import compile_plan
    from capplan.planner.hashing import spec_hash

    if plan.spec_hash != spec_hash(plan.spec):
        report.add("consistency", "spec_hash does not match the embedded spec")
    expected = compile_plan(plan.spec)
    for name in type(plan).model_fields:
        if getattr(expected, name) != getattr(plan, name):
            report.add("consistency", f"{name} differs from what the embedded spec compiles to")


def eager_regions(plan: Plan) -> list[str]:
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
