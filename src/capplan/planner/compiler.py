"""spec -> Plan. Pure: no I/O, no torch, no vLLM."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from capplan.planner.candidates import build_ranges
from capplan.planner.capture_sizes import resolve_capture_sizes
from capplan.planner.descriptors import capture_order, descriptors_by_mode
from capplan.planner.deviations import ExactTwin, describe_deviations
from capplan.planner.dummy_layout import DummyLayouts
from capplan.planner.dummy_runs import dummy_runs
from capplan.planner.hashing import fingerprint, spec_hash
from capplan.planner.lora_cases import lora_capture_cases, lora_dispatch_map, reachable_cases
from capplan.planner.tiers import tier_plan
from capplan.releases import runs_on
from capplan.schemas.plan import FORMAT_VERSION, Descriptor, Deviation, DPPolicy, EncoderPlan, Plan, PlannedGraph
from capplan.schemas.spec import Fix, Spec

ByMode = dict[str, list[Descriptor]]  # descriptors per cg_mode


class Reachable(Protocol):
    """Requests a graph holds -> the LoRA cases a batch of that many requests can reach."""

    seqs: int  # max_num_seqs: what a PIECEWISE graph holds

    def __call__(self, holds: int) -> set[int]: ...


DP_SYNC = (
    "ranks all-reduce num_tokens and cg_mode; all pad to the max num_tokens, the "
    "lowest mode wins, then each rank re-dispatches with its own LoRA count"
)


def compile_plan(spec: Spec, *, with_deviations: bool = True) -> Plan:
    """Compile a validated spec into its plan (deterministic, pure)."""
    return _compile(spec, with_deviations)


def _compile(spec: Spec, with_deviations: bool) -> Plan:
    sizes, max_size = resolve_capture_sizes(spec)
    cases = lora_capture_cases(spec)
    dispatch_map = lora_dispatch_map(cases)
    dropped: list[Descriptor] = []
    reachable = _reachability(spec, dispatch_map) if spec.has(Fix.prune_unreachable) else None
    if spec.cudagraph.lora_case_sizes is None:
        # Every case gets every size, so padded sizes never depend on the LoRA
        # case (pruning only drops pairs no batch reaches): prune while building.
        by_mode = descriptors_by_mode(spec, sizes, max_size, cases, reachable, dropped)
        lora_invariant = True
    else:
        full = _case_sizes(spec, descriptors_by_mode(spec, sizes, max_size, cases), cases)
        lora_invariant = _lora_invariant(full, cases)
        by_mode = _prune(full, reachable, dropped) if reachable is not None else full
    ordered = capture_order(by_mode)
    ids = {id(d): i for i, d in enumerate(ordered)}
    per_mode = spec.rules.per_mode_ranges or spec.has(Fix.mixed_ranges)
    layout = DummyLayouts(spec)
    graphs = [PlannedGraph.trusted(id=i, descriptor=d, dummy=layout(d)) for i, d in enumerate(ordered)]
    # Inputs are validated; the plan is assembled without re-validation, and
    # validated in full whenever a plan file is loaded.
    plan = Plan.trusted(
        format_version=FORMAT_VERSION,
        spec_hash=spec_hash(spec),
        # The plan's `target.vllm`: the releases it runs on (those planning alike with the spec's).
        target={"runner": spec.target.runner, "vllm": ", ".join(runs_on(spec.target.vllm))},
        fingerprint=fingerprint(spec, sizes, cases),
        spec=spec,
        fixes=[f.value for f in spec.fixes],
        deviations=[],
        decode_query_len=spec.decode_query_len,
        capture_sizes=sizes,
        max_capture_size=max_size,
        lora_capture_cases=cases,
        lora_dispatch_key="kernel_slots" if spec.has(Fix.lora_slot) else "adapters",
        lora_dispatch_map=dispatch_map,
        graphs=graphs,
        dispatch=build_ranges(by_mode, cases, ids, per_mode),
        dummy_runs=dummy_runs(spec, [d.num_tokens for d in ordered if d.num_reqs is None]),
        dp=DPPolicy.trusted(
            data_parallel_size=spec.parallel.synced_size,
            sync=DP_SYNC,
            lora_agreement="local",
            padded_tokens_lora_invariant=lora_invariant,
        ),
        stats=_stats(ordered, cases),
        encoder=_encoder(spec),
        tiers=tier_plan(spec, graphs) if spec.tiers is not None else None,
    )
    if not with_deviations:
        return plan
    deviations = []
    if spec.fixes:  # what each fix changed: the plan against its twin without the fix
        twin = ExactTwin(plan, lambda per_mode: build_ranges(by_mode, cases, ids, per_mode), dropped)
        deviations += describe_deviations(plan, twin)
    if spec.cudagraph.lora_case_sizes is not None:
        deviations.append(_case_sizes_deviation(spec, sizes))
    return plan.model_copy(update={"deviations": deviations}) if deviations else plan


TOWER_LORA = (
    "set per encoder batch before the encoder runs (set_active_mm_loras: TOWER mapping, then CONNECTOR), "
    "one adapter id per item"
)


def _encoder(spec: Spec) -> EncoderPlan | None:
    """The plan's encoder section (None for a text model)."""
    from capplan.planner.encoder import encoder_plan_graphs

    if spec.multimodal is None:
        return None
    vllm, planned = encoder_plan_graphs(spec)
    return EncoderPlan.trusted(
        budgets=sorted(planned.budgets, reverse=True) if planned else [],
        max_items=vllm.max_items if vllm else 0,
        max_frames=vllm.max_frames if vllm else 0,
        vllm_budgets=sorted(vllm.budgets, reverse=True) if vllm else [],
        lora=TOWER_LORA if spec.multimodal.tower_connector_lora else None,
    )


def _case_sizes_deviation(spec: Spec, sizes: list[int]) -> Deviation:
    assert spec.cudagraph.lora_case_sizes is not None
    changes = [
        f"capture: LoRA case {e.case}: {len(e.sizes)} of {len(sizes)} capture sizes "
        f"({', '.join(map(str, e.sizes[:10]))}{', ...' if len(e.sizes) > 10 else ''}); batches of that case "
        "pad to the next of these"
        for e in spec.cudagraph.lora_case_sizes
    ]
    return Deviation(
        fix="lora_case_sizes",
        failure_class="cost: vLLM captures every size for every LoRA case; "
        "capplan captures per case what the traffic uses (DP size 1 only)",
        changes=changes,
    )


def _case_sizes(spec: Spec, by_mode: ByMode, cases: list[int]) -> ByMode:
    """Keep, for each listed LoRA case, only its listed sizes (FULL decode graphs by the size they came from).

    Spec validation refuses a listed case that is not one of `cases`."""
    assert spec.cudagraph.lora_case_sizes is not None and spec.cudagraph.capture_sizes is not None
    wanted = {entry.case: set(entry.sizes) for entry in spec.cudagraph.lora_case_sizes}
    if not wanted.keys() <= set(cases):  # a spec built without validation (model_copy)
        raise ValueError(f"lora_case_sizes lists a case outside {cases}: validate the spec first")
    dql, top = spec.decode_query_len, spec.cudagraph.capture_sizes[-1]

    def keep(d: Descriptor) -> bool:
        sizes = wanted.get(d.num_active_loras)
        if sizes is None:
            return True
        if d.num_reqs is not None and d.uniform_token_count is not None:  # FULL decode: rounded up
            return any(-(-s // dql) * dql == d.num_tokens for s in sizes if s <= top)
        return d.num_tokens in sizes

    return {mode: [d for d in descs if keep(d)] for mode, descs in by_mode.items()}


def _reachability(spec: Spec, dispatch_map: dict[int, int]) -> Reachable:
    """requests a graph holds -> the LoRA cases a batch of that many requests can reach (memoized)."""
    memo: dict[int, set[int]] = {}

    def reachable(holds: int) -> set[int]:
        found = memo.get(holds)
        if found is None:
            found = memo[holds] = reachable_cases(spec, dispatch_map, holds)
        return found

    reachable.seqs = spec.scheduler.max_num_seqs  # type: ignore[attr-defined]
    return reachable  # type: ignore[return-value]  # a function with the attribute set above


def _prune(by_mode: ByMode, reachable: Reachable, dropped: list[Descriptor]) -> ByMode:
    """Drop (descriptor, LoRA case) pairs no reachable batch can dispatch to.

    A batch padded to a graph of n tokens and r requests (PIECEWISE: any
    count up to min(n, max_num_seqs)) holds at most min(r, n) requests.
    Dispatch for every reachable batch is unchanged: the graph it picked
    holds at least as many requests as the batch, so its case survives.
    """
    kept: ByMode = {}
    for mode, descs in by_mode.items():
        for d in descs:
            holds = d.num_reqs if d.num_reqs is not None else reachable.seqs
            if d.num_active_loras in reachable(min(holds, d.num_tokens)):
                kept.setdefault(mode, []).append(d)
            else:
                dropped.append(d)
    return kept


def _lora_invariant(by_mode: ByMode, cases: list[int]) -> bool:
    """Every LoRA case has the same token sizes per mode, so a rank's LoRA count
    can never change the padded token count the DP ranks agreed on."""
    for descs in by_mode.values():
        sizes: dict[int, list[int]] = {c: [] for c in cases}
        for d in descs:
            sizes[d.num_active_loras].append(d.num_tokens)
        if len({tuple(sorted(v)) for v in sizes.values()}) > 1:
            return False
    return True


def _stats(ordered: list[Descriptor], cases: list[int]) -> dict[str, dict[str, int]]:
    counts = Counter((d.cg_mode, d.num_active_loras) for d in ordered)
    stats: dict[str, dict[str, int]] = {}
    for mode in ("PIECEWISE", "FULL"):
        row = {str(c): counts[(mode, c)] for c in cases}
        if any(row.values()):
            stats[mode] = row
    stats["total"] = {mode: sum(row.values()) for mode, row in stats.items()}
    stats["total"]["graphs"] = len(ordered)
    return stats
