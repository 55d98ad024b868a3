"""What `capplan verify` prints, from its records (`analysis.verify`): eager ranges and the
verdict on stdout, violations on stderr; or, with --json, every record with its typed
fields and its sentence."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, assert_never

from capplan.analysis.verify import (
    AboveLargestGraph,
    AnchorDeferred,
    AnyViolation,
    BadAdapterIds,
    CandidateCannotHold,
    CoverageHole,
    DpDisagreement,
    DpInvariantMismatch,
    DpMoreDisagreements,
    DpSizeMismatch,
    DummyLayoutMismatch,
    DummyMaxQueryLen,
    DummyRunTooLong,
    DummyTooLong,
    Eager,
    EagerRegion,
    EncoderLoraSkipped,
    FallbackCannotReplay,
    FallbackLoop,
    FieldDiffers,
    GraphMisplaced,
    KernelGridMismatch,
    KernelsShortCircuit,
    LoraOffGraphCarriesLora,
    MalformedRange,
    NoLoraGraphWarmed,
    PiledRemainder,
    RangesOverlap,
    ShortFallbackGrid,
    ShortKernelGrid,
    SpecHashMismatch,
    TiersMalformed,
    VerifyReport,
    WrongAdapterCount,
)
from capplan.present.jsondoc import dumps, record_value
from capplan.schemas.plan import Descriptor, Plan, address


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}..{hi}"


def _cases(cases: tuple[int, ...], every: bool) -> str:
    if every:
        return "all LoRA cases"
    return ("LoRA case " if len(cases) == 1 else "LoRA cases ") + ", ".join(map(str, cases))


def _where(region: CoverageHole | EagerRegion) -> str:
    """`LoRA case 0: mixed batches of more than 4 requests, 4 token count(s) (5..8)`."""
    spans = region.token_runs
    listed = ", ".join(_span(lo, hi) for lo, hi in spans[:8]) + (", ..." if len(spans) > 8 else "")
    who = f"{region.batch_kind} batches" + (f" of more than {region.served} requests" if region.served else "")
    return f"{_cases(region.lora_cases, region.every_case)}: {who}, {region.token_count} token count(s) ({listed})"


def _sample(descs: tuple[Descriptor, ...]) -> str:
    labels = [address(d) for d in descs[:4]]
    return ", ".join(labels) + (", ..." if len(descs) > 4 else "")


DUMMY_RUN_FIX = {
    "dummy_remainder": "turn on the dummy_remainder fix",
    "limits": "raise max_num_seqs or max_model_len",
}


def violation_message(v: AnyViolation) -> str:
    """The sentence `capplan verify` prints for a violation (after `[kind] `)."""
    match v:
        case GraphMisplaced():
            return f"graph #{v.graph_id} is listed at position {v.position}"
        case MalformedRange():
            if v.unknown_ids:
                return (
                    f"dispatch range case {v.lora_case} tokens {v.lo}..{v.hi} "
                    f"is malformed (unknown graph ids {list(v.unknown_ids)})"
                )
            return f"dispatch range case {v.lora_case} has lo {v.lo} > hi {v.hi}"
        case CandidateCannotHold():
            return f"case {v.lora_case} tokens {v.lo}..{v.hi} lists graph {address(v.graph)} that cannot hold them"
        case RangesOverlap():
            (a_lo, a_hi), (b_lo, b_hi) = v.first, v.second
            return f"case {v.lora_case}: dispatch ranges {a_lo}..{a_hi} and {b_lo}..{b_hi} overlap"
        case DummyLayoutMismatch():
            return (
                f"graph {address(v.graph)}: dummy layout of {v.dummy_reqs} requests / {v.dummy_tokens} tokens "
                f"does not capture {v.reqs} requests / {v.tokens} tokens"
            )
        case DummyMaxQueryLen():
            return f"graph {address(v.graph)}: dummy max_query_len {v.max_query_len} != longest request {v.longest}"
        case KernelGridMismatch():
            return (
                f"graph {address(v.graph)}: kernel_grid {v.kernel_grid} does not follow from its dummy ({v.expected})"
            )
        case TiersMalformed():
            if v.field == "deferred":
                return "tiers.deferred lists a graph twice or a graph the plan does not have"
            return "tiers.fallback does not name exactly one graph of the plan per deferred graph"
        case CoverageHole():
            return f"{_where(v)} run eager although a captured {v.cg_mode} graph could serve them"
        case DummyTooLong():
            if v.limit == "max_model_len":
                return (
                    f"graph {address(v.graph)}: dummy request of {v.longest} tokens exceeds max_model_len "
                    f"{v.limit_tokens}"
                )
            return f"graph {address(v.graph)}: dummy request of {v.longest} tokens exceeds the graph's max_query_len"
        case DummyRunTooLong():
            fix = DUMMY_RUN_FIX.get(v.fix) or (
                "a one-request batch: no remainder fix shortens it; keep the largest PIECEWISE graph "
                f"(cudagraph.max_capture_size) at most {v.max_model_len}"
            )
            return (
                f"{v.run} dummy run of {v.tokens} tokens: a request of {v.longest} "
                f"tokens exceeds max_model_len {v.max_model_len} ({fix})"
            )
        case PiledRemainder():
            return (
                f"{v.count} dummy batch(es) pile the token remainder on one request "
                f"(worst: graph {address(v.graph)}, {v.longest} tokens where an even split needs {v.even})"
            )
        case LoraOffGraphCarriesLora():
            return f"graph {address(v.graph)}: LoRA is off but the graph carries a LoRA case or dummy adapters"
        case NoLoraGraphWarmed():
            return f"graph {address(v.graph)}: a no-LoRA graph is warmed with adapters {list(v.adapters)}"
        case WrongAdapterCount():
            return f"graph {address(v.graph)}: warmed with {v.warmed} adapters, the case needs {v.needed}"
        case BadAdapterIds():
            return f"graph {address(v.graph)}: dummy adapter ids {list(v.lora_ids)} are not -1 or 1..{v.max_loras}"
        case KernelsShortCircuit():
            return (
                f"graph {address(v.graph)}: every dummy request is -1, so the LoRA kernels "
                "short-circuit and are not recorded in the graph"
            )
        case ShortKernelGrid():
            return (
                f"LoRA case {v.lora_case}: {len(v.graphs)} graph(s) ({_sample(v.graphs)}) record a kernel grid "
                f"of {v.kernel_grid} but serve {v.example} ({v.slots} kernel slots): an adapter is skipped"
            )
        case ShortFallbackGrid():
            pairs = [f"{address(g)} -> {address(f)}" for g, f in v.fallbacks]
            return (
                f"{len(pairs)} deferred graph(s) fall back to a graph whose kernel grid ({v.kernel_grid}) is smaller "
                f"than the {v.slots} adapter slots their batches bring "
                f"({', '.join(pairs[:3])}{', ...' if len(pairs) > 3 else ''}): until captured, an adapter is skipped"
            )
        case DpDisagreement():

            def side(padded: int) -> str:
                return "runs eager" if padded == v.tokens else f"pads to {padded}"

            return (
                f"an agreed {v.batch_kind} batch of {v.tokens} tokens {side(v.low_padded)} on a rank with LoRA "
                f"case {v.low_case} and {v.low_reqs} request(s) but {side(v.high_padded)} on one with case "
                f"{v.high_case} and {v.high_reqs}"
            )
        case DpMoreDisagreements():
            return f"... and {v.count} more token counts where DP ranks can disagree"
        case DpSizeMismatch():
            return f"dp.data_parallel_size {v.plan_size} != spec {v.spec_size}"
        case DpInvariantMismatch():
            return f"dp.padded_tokens_lora_invariant says {v.plan_says}, the tables say {v.tables_say}"
        case SpecHashMismatch():
            return "spec_hash does not match the embedded spec"
        case FieldDiffers():
            return f"{v.field} differs from what the embedded spec compiles to"
        case EncoderLoraSkipped():
            return (
                f"{len(v.budgets)} encoder graph(s) {', '.join(f'ENCODER:{b}' for b in v.budgets)} are captured "
                "with tower/connector LoRA on and specialize_active_lora: the LoRA kernels launch with 0 active "
                "adapters at capture, so vision requests with an adapter get base-tower outputs "
                "(fix: encoder_lora_eager)"
            )
        case AnchorDeferred():
            return (
                f"graph {address(v.graph)} is the largest of its mode and LoRA case but deferred: its batches have no "
                "captured graph to fall back on (and vLLM sizes the FULL output buffer by it)"
            )
        case FallbackLoop():
            return f"graph {address(v.graph)}: its fallbacks loop or end in a deferred graph"
        case FallbackCannotReplay():
            return (
                f"graph {address(v.graph)} falls back to {address(v.fallback)}, which cannot replay its batches "
                "(mode, decode shape, tokens or requests)"
            )
        case _:
            assert_never(v)


def violation_line(v: AnyViolation) -> str:
    """The violation as `capplan verify` lists it: its kind, then its sentence."""
    return f"[{v.kind}] {violation_message(v)}"


def eager_regions(plan: Plan) -> list[str]:
    """The plan's eager regions as the sentences `capplan verify` prints."""
    from capplan.analysis.verify import eager_records

    return [eager_text(region) for region in eager_records(plan)]


def eager_text(region: Eager) -> str:
    """The line `capplan verify` prints after `eager: ` (and `show` lists)."""
    if isinstance(region, AboveLargestGraph):
        return f"all batches of {region.lo}..{region.hi} tokens run eager (above the largest graph)"
    return f"{_where(region)} run eager (no captured graph can hold them)"


def _fields(record: object) -> dict[str, Any]:
    assert is_dataclass(record)
    out = {f.name: record_value(getattr(record, f.name)) for f in fields(record)}
    if isinstance(record, (CoverageHole, EagerRegion)):
        out["token_count"] = record.token_count
    return out


def violation_json(v: AnyViolation) -> dict[str, Any]:
    """One violation: what it is (`type`, `kind`, its failure class), its fields, its sentence."""
    c = v.failure_class
    return {
        "type": v.code,
        "kind": v.kind,
        "failure_class": c.label,
        "class_number": c.number,
        "class_name": c.name,
        **_fields(v),
        "message": violation_message(v),
    }


def eager_json(region: Eager) -> dict[str, Any]:
    return {"type": region.code, **_fields(region), "text": eager_text(region)}


def verify_json(report: VerifyReport) -> dict[str, Any]:
    """`capplan verify --json` (docs/cli.md, "JSON output", lists every field)."""
    return {
        "ok": report.ok,
        "violations": [violation_json(v) for v in report.violations],
        "eager_regions": [eager_json(r) for r in report.eager_regions],
        "checked": report.checked,
    }


def verify_lines(report: VerifyReport, plan_name: str, as_json: bool) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of a verify report."""
    if as_json:
        out = [dumps(verify_json(report), indent=2)]
    else:
        out = [f"eager: {eager_text(region)}" for region in report.eager_regions]
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
        if report.ok:
            out.append(f"ok: {plan_name} is free of every failure class ({checked} checked)")
    return out, [f"violation: {violation_line(v)}" for v in report.violations]
