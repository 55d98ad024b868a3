"""`capplan show`, `dispatch` and `verify`: questions asked of one plan file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capplan.analysis.verify import VerifyReport
from capplan.calibration.price import Priced
from capplan.commands import inputs
from capplan.errors import CapplanError, UsageError, printable
from capplan.planfile.read import load_plan
from capplan.planner.dispatch import Batch, Dispatch
from capplan.schemas.plan import Plan


@dataclass(frozen=True)
class Shown:
    """A plan and its price (`Priced`: what it rests on, or why it is not priced)."""

    plan: Plan
    priced: Priced


def graph_reserve(plan_path: Path, plan: Plan, calibration: Path | None = None) -> Priced | None:
    """For `flags`: the plan priced by the deployment's own calibration (--calibration, or the
    calibration folder found beside the plan). None where there is none, or where the price is
    not the deployment's own (no KV-cache size rests on the shape model's prediction; a
    --calibration given is answered either way)."""
    from capplan.calibration.price import load_pricer

    pricer = load_pricer(calibration, plan_path)
    if pricer.deployment is None and pricer.unread is None:
        return None
    priced = pricer.price(plan)
    said = priced.kind in ("measured", "scaled", "exact") or calibration is not None or pricer.unread is not None
    return priced if said else None


def show(
    plan_path: Path, calibration: Path | None = None, plot: Path | None = None, model_config: Path | None = None
) -> Shown:
    """Load a plan and price it; with `plot`, draw it there."""
    from capplan.calibration.price import load_pricer

    plan = load_plan(plan_path)
    priced = load_pricer(calibration, plan_path, model_config).price(plan)
    if plot is not None:
        from capplan.files import write_atomic
        from capplan.present.picture import eager_note, plan_grids
        from capplan.present.plot import plot_plan

        grids, legend = plan_grids(plan)
        totals = ", ".join(f"{mode} {n}" for mode, n in plan.stats["total"].items() if mode != "graphs")
        caption = f"capplan show {plan_path.name}: {plan.stats['total']['graphs']} graphs ({totals or 'all eager'})"
        picture = plot_plan(plot, grids, caption, legend, eager_note(plan))
        write_atomic(plot, picture, inputs(plan_path, calibration))
    return Shown(plan, priced)


@dataclass(frozen=True)
class DispatchQuestion:
    """`capplan dispatch`'s question: one batch (reqs and tokens), a batch file, or one encoder batch."""

    plan: Path
    reqs: int | None = None
    tokens: int | None = None
    loras: int = 0
    base: bool = False
    uniform: int | None = None
    max_query_len: int | None = None
    has_prefill: bool = False
    queries: Path | None = None
    encoder_items: str | None = None
    dp_ranks: str | None = None  # the other DP ranks' batches: TOKENS, REQSxTOKENS or idle, comma-separated


@dataclass(frozen=True)
class Explained:
    """One batch, the graph that serves it (cg_mode NONE: eager) and why."""

    batch: Batch
    dispatch: Dispatch
    trace: list[str]


@dataclass(frozen=True)
class Answers:
    """A batch file's batches, each one's descriptor in order."""

    descriptors: list[dict[str, Any]]


@dataclass(frozen=True)
class EncoderPacking:
    """One encoder batch packed as vLLM packs it: (item indices, budget or None for eager)."""

    items: list[int]
    batches: list[tuple[list[int], int | None]]
    eager_why: str
    has_graphs: bool
    packing: str = ""  # whose packing rule this is, and the releases the plan runs on that pack otherwise


def dispatch(question: DispatchQuestion) -> Explained | Answers | EncoderPacking:
    """Which captured graph serves the batch (or batches), and why."""
    from capplan.batches import batch_from_args, read_batches
    from capplan.planner.dispatch import Dispatcher

    q = question
    if q.encoder_items is not None:
        if q.reqs is not None or q.tokens is not None or q.queries is not None:
            raise UsageError("--encoder-items asks about an encoder batch; give it without --reqs/--tokens/--queries")
        return encoder_dispatch(load_plan(q.plan), q.encoder_items)
    if q.queries is not None:
        if q.reqs is not None or q.tokens is not None:
            raise UsageError("--queries replaces --reqs/--tokens; give one or the other")
        loaded = load_plan(q.plan)
        batches = read_batches(q.queries, loaded.spec).batches
        dispatcher = Dispatcher(loaded)
        return Answers([dispatcher.dispatch(item.batch).descriptor() for item in batches])
    if q.reqs is None or q.tokens is None:
        raise UsageError("give --reqs and --tokens (or --queries FILE.jsonl)")
    loaded = load_plan(q.plan)
    spec = loaded.spec
    batch = batch_from_args(q.reqs, q.tokens, q.max_query_len, q.loras, q.base, q.has_prefill, q.uniform, spec)
    trace: list[str] = []
    dispatcher = Dispatcher(loaded)
    desc = dispatcher.explain(batch, trace)
    if q.dp_ranks is not None:
        desc = dp_synced(dispatcher, loaded, batch, q.dp_ranks, trace)
    trace += deferred_note(loaded, desc.graph_id)
    return Explained(batch, desc, trace)


def other_ranks(text: str, plan: Plan) -> list[Batch | None]:
    """`--dp-ranks`: the other DP ranks' batches, comma-separated: TOKENS (that many one-token
    requests), REQSxTOKENS, or idle (the rank runs vLLM's dummy batch); one per other rank."""
    from capplan.batches import batch_problem
    from capplan.planner.dispatch import beyond_spec

    spec = plan.spec
    size = spec.parallel.synced_size
    if size == 1:
        why = "data_parallel_size 1" if spec.parallel.data_parallel_size == 1 else "a dense model's DP ranks"
        raise UsageError(
            f"--dp-ranks: this plan's ranks never pad to one another ({why}: each is an engine of its own)",
            "drop --dp-ranks; DP ranks sync only for an MoE model (parallel.moe: true) with data_parallel_size > 1",
        )
    parts = text.split(",")
    if len(parts) != size - 1:
        raise UsageError(
            f"--dp-ranks: give the other {size - 1} rank(s)' batches, comma-separated (got {len(parts)})",
            "each TOKENS, REQSxTOKENS or idle, e.g. " + ",".join(["64x64", "idle", "8x900"][: size - 1] or ["idle"]),
        )
    out: list[Batch | None] = []
    for n, part in enumerate(parts, 1):
        entry = part.strip().lower()
        if entry == "idle":
            out.append(None)
            continue
        reqs_text, _, tokens_text = entry.rpartition("x")
        try:
            tokens = int(tokens_text)
            reqs = int(reqs_text) if reqs_text else tokens
        except ValueError:
            raise UsageError(
                f"--dp-ranks: rank entry {n} is {printable(part)[:40]!r}, not TOKENS, REQSxTOKENS or idle"
            ) from None
        if not 1 <= reqs <= 1 << 30 or not 1 <= tokens <= 1 << 30:
            raise UsageError(f"--dp-ranks: rank entry {n}: requests and tokens must be from 1 to {1 << 30}")
        other = Batch(reqs, tokens, -(-tokens // reqs) if tokens >= reqs else tokens)
        problem = batch_problem(other) or beyond_spec(other, spec)
        if problem:
            raise UsageError(f"--dp-ranks: rank entry {n} ({printable(part)[:40]}): {problem}")
        out.append(other)
    return out


def dp_synced(dispatcher: Any, plan: Plan, batch: Batch, text: str, trace: list[str]) -> Dispatch:
    """What this rank replays once vLLM's DP sync has settled the step with the other ranks'
    batches (`--dp-ranks`), and why (appended to `trace`)."""
    from capplan.traffic.simulate import sync_step

    others = other_ranks(text, plan)
    step = sync_step(dispatcher, plan.spec, (batch, *others))
    tokens = ", ".join(str(b.num_tokens) if b is not None else "idle" for b in (batch, *others))
    trace.append(
        f"with DP sync over {len(others) + 1} ranks (this one first; tokens {tokens}): "
        + (
            "some rank would run eager, so every rank runs eager with its own tokens"
            if step.mode == "NONE"
            else f"every rank pads to {step.tokens} tokens, mode {step.mode} (the lowest any rank wanted), "
            + (
                f"uniform decode count {step.uniform} (every rank has it)"
                if step.uniform is not None
                else "no uniform decode count (the ranks differ)"
            )
        )
    )
    final = step.ranks[0][1]
    trace.append(
        "this rank's batch then dispatches "
        + ("eager" if final.graph_id < 0 else f"at {final.num_tokens} tokens with its own LoRA count")
    )
    return final


def deferred_note(plan: Plan, graph_id: int) -> list[str]:
    """When the graph is deferred (spec tiers): what the batch replays until it is captured."""
    from capplan.planner.tiers import chain
    from capplan.schemas.plan import address

    tiers = plan.tiers
    if tiers is None or graph_id < 0 or graph_id not in tiers.fallback:
        return []
    links = chain(tiers, graph_id)
    stand_ins = ", then ".join(address(plan.graphs[g].descriptor) for g in links[1:])
    return [
        f"deferred: captured while the engine serves; until then this batch replays {stand_ins} "
        "(the first of them captured; the last is ready)"
    ]


def encoder_dispatch(plan: Plan, items_text: str) -> EncoderPacking:
    """How vLLM packs one encoder batch (`items_text`: comma-separated token counts) onto the plan's graphs."""
    from capplan.planner.encoder import EncoderGraphs, pack

    enc = plan.encoder
    if enc is None:
        raise UsageError("this plan has no multimodal encoder (no multimodal section in its spec)")
    try:
        items = [int(part) for part in items_text.split(",")]
    except ValueError:
        raise UsageError(
            f"--encoder-items: give comma-separated token counts, e.g. 300,1200,40 (got {items_text!r})"
        ) from None
    if not items or len(items) > 10_000 or min(items) < 1 or max(items) > 1 << 24:
        raise UsageError("--encoder-items: 1 to 10000 items, each 1 to 16777216 tokens")
    batches: list[tuple[list[int], int | None]]
    if not enc.budgets:
        batches = [(list(range(len(items))), None)]
        why = "the plan captures no encoder graphs" + (" (encoder_lora_eager)" if enc.vllm_budgets else "")
    else:
        graphs = EncoderGraphs(sorted(enc.budgets), enc.max_items, enc.max_frames)
        batches = pack(graphs, items, defer=plan.spec.rules.encoder_packing_defers)
        why = "above the largest budget"
    return EncoderPacking(items, batches, why, bool(enc.budgets), _packing(plan))


def _packing(plan: Plan) -> str:
    """Whose encoder packing `dispatch --encoder-items` shows, and which releases the plan runs on
    pack otherwise (an alias's older ones)."""
    from capplan.releases import RELEASES, release_of, runs_on

    defers = plan.spec.rules.encoder_packing_defers
    other = [v for v in runs_on(plan.spec.target.vllm) if RELEASES[v].rules.encoder_packing_defers != defers]
    text = f"packing as vLLM {release_of(plan.spec.target.vllm).version} does"
    if other:
        how = "never starts" if defers else "starts"
        text += f" (vLLM {', '.join(other)} {how} a new batch for a large item early)"
    return text


def verify(plan_path: Path) -> VerifyReport:
    """The verifier's report on a plan file."""
    from capplan.analysis.verify import verify_plan

    # A loaded plan is the one its spec compiles to (the loader compared them): no second compile.
    return verify_plan(load_plan(plan_path), consistency=False)


def deployment_flags(spec_path: Path, form: str) -> str:
    """`capplan flags SPEC` for a spec whose `deployment` section names the deployment's vLLM
    config: the deployment's own line (its --config file and every flag it gives, kept whole)
    with what the plan adds, as `capplan apply` would run it; CAPPLAN_PLAN names the plan
    `capplan compile SPEC` writes."""
    import json
    import shlex

    from capplan.commands.compile import compile_target
    from capplan.envvars import PLAN as PLAN_ENV
    from capplan.launcher.engine_args import complete
    from capplan.planfile.paths import default_plan_path

    plan_path = default_plan_path(spec_path)
    job = compile_target(spec_path, plan_path)
    if job.deployment is None:
        raise UsageError(
            f"{printable(str(spec_path))}: a spec with no deployment section (the plan alone gives the arguments)",
            "give its plan: capplan flags PLAN",
        )
    if form in ("yaml", "python"):
        raise UsageError(
            f"--format {form}: for a deployment spec capplan prints the deployment's own line as it is",
            "use --format serve (the line) or json (its arguments), or capplan flags PLAN for the plan alone",
        )
    from capplan.planfile.compare import stale_reason

    why = stale_reason(plan_path, job.data)
    if why is not None:  # CAPPLAN_PLAN would name a plan that is not this spec's
        raise CapplanError(
            f"{printable(str(plan_path))} is not what {printable(str(spec_path))} compiles to ({why})",
            f"run capplan compile {printable(str(spec_path))} first",
        )
    full, _ = complete(job.plan, job.deployment.cmd)
    if form == "json":
        return json.dumps(full[job.deployment.start :], indent=2)
    return shlex.join([f"{PLAN_ENV}={plan_path}", *full])
