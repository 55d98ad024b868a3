"""The `capplan` command: thin typer commands over the library.

Data goes to stdout, diagnostics to stderr. Library errors become one line
and an exit code here, in one place: 1 for bad input, 2 for usage errors.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from capplan.errors import CapplanError, InputError, UsageError, printable


def _dumps(data: object, **kwargs: object) -> str:
    """JSON output is strict JSON: a NaN or an infinity is a bug, never printed as `NaN`."""
    return json.dumps(data, allow_nan=False, **kwargs)  # type: ignore[arg-type]


app = typer.Typer(
    name="capplan",
    help=(
        "Compile a vLLM deployment spec into a reviewable CUDA-graph capture plan, "
        "inspect it, and ask which graph serves a batch.\n\n"
        "  capplan compile configs/deploy.yaml        # -> configs/deploy.plan.yaml\n\n"
        "  capplan show configs/deploy.plan.yaml\n\n"
        "  capplan dispatch configs/deploy.plan.yaml --reqs 3 --tokens 17 --loras 2 --base"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_DEBUG = False
CalibrationOption = Annotated[
    Path | None, typer.Option("--calibration", help="Cost calibration YAML (default: H200, vLLM 0.25).")
]


def _print_version(value: bool) -> None:
    if value:
        from capplan import __version__

        typer.echo(f"capplan {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks instead of one-line errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print capplan's version and exit."),
    ] = False,
) -> None:
    global _DEBUG
    _DEBUG = _DEBUG or debug


def _errors_to_exit(fn: Callable) -> Callable:
    """Map library errors to `error: ...` on stderr and an exit code; no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CapplanError as exc:
            if _DEBUG:
                raise
            typer.echo(f"error: {exc.one_line()}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: nothing was written", err=True)
            raise typer.Exit(code=130) from None
        except BrokenPipeError:
            raise
        except OSError as exc:
            if _DEBUG:
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            typer.echo(f"error: {printable(where + str(exc.strerror or exc))}", err=True)
            raise typer.Exit(code=1) from None

    return wrapper


def _relative(path: Path, base: Path) -> str:
    """`path` relative to the folder `base` (never absolute: the bare name when no
    relative path exists), escaped to one line."""
    try:
        rel = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
    except ValueError:
        rel = path.name
    return printable(rel)


def default_plan_path(spec_path: Path) -> Path:
    name = spec_path.name
    for suffix in (".yaml", ".yml"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return spec_path.with_name(name + ".plan.yaml")


def regenerate_command(spec_path: Path, plan_path: Path, base: Path) -> str:
    """The command that rewrites `plan_path` from `spec_path`, run from the folder `base`
    (`-o` only when the plan is not next to the spec under its default name)."""
    command = f"capplan compile {_relative(spec_path, base)}"
    if plan_path.resolve() != default_plan_path(spec_path).resolve():
        command += f" -o {_relative(plan_path, base)}"
    return command


def _summary(plan) -> str:
    parts = []
    for mode in ("PIECEWISE", "FULL"):
        row = plan.stats.get(mode)
        if row:
            cases = ", ".join(f"case {c}: {n}" for c, n in row.items())
            parts.append(f"{mode} {sum(row.values())} ({cases})")
    total = plan.stats["total"]["graphs"]
    return f"{total} graphs" + (": " + "; ".join(parts) if parts else " (cudagraph mode NONE: all eager)")


@app.command("compile")
@_errors_to_exit
def compile_cmd(
    specs: Annotated[list[Path], typer.Argument(help="Deployment spec(s) (YAML).", show_default=False)],
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Plan path (one spec only). Default: SPEC with .plan.yaml."),
    ] = None,
    plan_dir: Annotated[
        Path | None,
        typer.Option("--plan-dir", help="Put each plan in this folder as NAME.plan.yaml."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be written; write nothing.")] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Also print the plan as JSON on stdout (the plan file is still written; add --dry-run to "
            "write nothing).",
        ),
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Recompile in memory and compare with the existing plan; exit 1 if stale. Writes nothing.",
        ),
    ] = False,
    skip_non_specs: Annotated[
        bool,
        typer.Option(
            "--skip-non-specs",
            help="Skip YAML files with none of a spec's sections (target, scheduler, cudagraph, lora, "
            "speculative, parallel, fixes), e.g. a CI config; for hooks that see every YAML file.",
        ),
    ] = False,
) -> None:
    """Compile SPEC into a capture plan (atomic write; summary on stderr).

    With --check, nothing is written: exit 0 when each plan holds exactly what its
    spec compiles to (comments, the spec's file name and where you run it from do
    not matter), 1 with `plan is stale: run COMMAND` otherwise.
    """
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_spec, plan_difference
    from capplan.planfile import plan_file_data, plan_to_json, render_plan
    from capplan.planner import compile_plan

    if output is not None and (len(specs) > 1 or plan_dir is not None):
        raise UsageError("-o names one plan: give one spec and no --plan-dir")
    targets: list[tuple[Path, Path]] = []
    written: dict[str, Path] = {}  # real path of each plan -> the spec writing it
    for spec in specs:
        if skip_non_specs and not _looks_like_spec(spec):
            continue
        plan_path = output or default_plan_path(spec)
        if plan_dir is not None:
            plan_path = plan_dir / default_plan_path(spec).name
        other = written.setdefault(os.path.realpath(plan_path), spec)
        if other is not spec:
            raise UsageError(
                f"{printable(str(other))} and {printable(str(spec))} would both be written to "
                f"{printable(str(plan_path))}",
                "compile them one at a time with -o",
            )
        if not check and not dry_run:
            check_output(plan_path, specs)
        targets.append((spec, plan_path))
    # Compile everything before writing anything: one bad spec writes nothing.
    jobs = []
    for spec, plan_path in targets:
        plan = compile_plan(load_spec(spec))
        folder = plan_path.parent
        data = plan_file_data(plan)
        text = render_plan(plan, _relative(spec, folder), regenerate_command(spec, plan_path, folder), data)
        _refuse_unloadable(spec, text, data)
        jobs.append((spec, plan_path, plan, text, data))
    stale = []
    for spec, plan_path, plan, text, data in jobs:
        if check:
            why = _stale_reason(plan_path, data, plan_difference)
            if why is not None:
                stale.append(f"plan is stale ({why}): run {regenerate_command(spec, plan_path, Path.cwd())}")
            else:
                typer.echo(f"{printable(str(plan_path))}: up to date ({_summary(plan)})", err=True)
            continue
        if as_json:
            typer.echo(_dumps(plan_to_json(plan), indent=2))
        if dry_run:
            if not as_json:
                sys.stdout.write(text)
            typer.echo(f"dry run: would write {printable(str(plan_path))}: {_summary(plan)}", err=True)
            continue
        try:  # text mode: a CRLF checkout of the same plan is unchanged
            unchanged = plan_path.read_text(encoding="utf-8") == text
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
            unchanged = False
        if unchanged:
            typer.echo(f"{printable(str(plan_path))}: unchanged, {_summary(plan)}", err=True)
            continue
        write_atomic(plan_path, text, specs)
        typer.echo(f"wrote {printable(str(plan_path))}: {_summary(plan)}", err=True)
    if stale:
        for line in stale[:-1]:
            typer.echo(f"error: {line}", err=True)
        raise CapplanError(stale[-1])


def _refuse_unloadable(spec: Path, text: str, data: dict) -> None:
    """Refuse a spec whose plan file (`text`, its content `data`) no command could load."""
    from capplan.loading import size_problem

    problem = size_problem(text, data)
    if problem is not None:
        raise CapplanError(
            f"{spec}: the plan would be {problem}, so no command could load it",
            "capture fewer sizes or LoRA cases: set cudagraph.capture_sizes or max_capture_size",
        )


def _compile_spec(spec: Path):
    """The plan a spec compiles to, refused like `capplan compile` refuses it when no
    command could load its file (for commands that compare specs in memory)."""
    from capplan.loading import load_spec
    from capplan.planfile import plan_file_data, render_plan
    from capplan.planner import compile_plan

    plan = compile_plan(load_spec(spec))
    data = plan_file_data(plan)
    _refuse_unloadable(spec, render_plan(plan, spec.name, None, data), data)
    return plan


def _looks_like_spec(path: Path) -> bool:
    """Whether a YAML file has any of a spec's top-level sections (else it is skipped, with a note)."""
    from capplan.errors import SpecError
    from capplan.files import read_text, read_yaml
    from capplan.schemas.spec import Spec

    try:
        data = read_yaml(path, "spec", SpecError)
    except SpecError:
        # Not YAML capplan reads (several documents, custom tags, YAML 1.1 numbers, a
        # template): a spec only if a line starts one of a spec's sections, so a misspelt
        # spec still fails while a Kubernetes manifest or a playbook is skipped.
        try:
            text = read_text(path, "spec", SpecError)
        except SpecError:
            return True  # not readable at all: let the real load say why
        sections = tuple(f"{name}:" for name in Spec.model_fields)
        if any(line.startswith(sections) for line in text.splitlines()):
            return True
        names = "|".join(Spec.model_fields)
        if text.lstrip().startswith("{") and re.search(rf'[{{,]\s*["\']?(?:{names})["\']?\s*:', text):
            return True  # a spec in flow (JSON) style
        data = None
    if isinstance(data, dict) and "graphs" not in data and set(data) & set(Spec.model_fields):
        return True
    typer.echo(f"{printable(str(path))}: skipped, not a capplan spec (no spec section)", err=True)
    return False


def _inputs(*paths: Path | None) -> tuple[Path, ...]:
    """A command's input files (an optional one, such as --calibration, may be None): no
    output of the command may overwrite them."""
    return tuple(p for p in paths if p is not None)


def _write_picture(path: Path, content: str | bytes, inputs: tuple[Path, ...]) -> None:
    from capplan.files import write_atomic

    write_atomic(path, content, inputs)


def _stale_reason(plan_path: Path, expected: dict, difference) -> str | None:
    """Why the plan file does not hold `expected` (its content as data), or None."""
    from capplan.errors import PlanError
    from capplan.files import read_yaml

    if not plan_path.exists():
        return f"{plan_path} does not exist"
    try:
        current = read_yaml(plan_path, "plan", PlanError)
    except PlanError as exc:
        return exc.message
    version = current.get("format_version") if isinstance(current, dict) else None
    if version != expected["format_version"] or type(version) is not int:
        return f"{plan_path} is format {version!r}, this capplan writes format {expected['format_version']}"
    found = difference(current, expected)
    return None if found is None else f"{plan_path}: {found}"


@app.command("show")
@_errors_to_exit
def show_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Machine-readable plan: capture_sizes, lora_capture_cases, lora_dispatch_map, "
            "descriptors (capture order), and everything else the plan holds.",
        ),
    ] = False,
    calibration: CalibrationOption = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Draw the plan: captured and pruned graphs per capture size and LoRA case, per mode, and the "
            "batches that run eager (.svg, or .png with capplan[plot]).",
        ),
    ] = None,
) -> None:
    """Tables of what will be captured and how token ranges and LoRA counts dispatch.

    Graphs are named MODE:TOKENS[xREQUESTS]@LORA_CASE: PIECEWISE:128@4 is the
    PIECEWISE graph of 128 tokens for LoRA case 4; FULL:64x64@4 the FULL graph of
    64 tokens padded to 64 requests.
    """
    from capplan.loading import load_cost_model, load_plan
    from capplan.planfile import plan_to_json
    from capplan.present.show import render_show

    loaded = load_plan(plan)
    cost = load_cost_model(calibration)
    basis = cost.basis(loaded.spec)
    estimate = cost.estimate(loaded) if basis.usable else None
    if plot is not None:
        from capplan.present.picture import eager_note, plan_grids
        from capplan.present.plot import plot_plan

        grids, legend = plan_grids(loaded)
        totals = ", ".join(f"{mode} {n}" for mode, n in loaded.stats["total"].items() if mode != "graphs")
        caption = f"capplan show {plan.name}: {loaded.stats['total']['graphs']} graphs ({totals or 'all eager'})"
        inputs = _inputs(plan, calibration)
        _write_picture(plot, plot_plan(plot, grids, caption, legend, eager_note(loaded)), inputs)
    if as_json:
        data = plan_to_json(loaded)
        data["estimate"] = {
            "graphs": len(loaded.graphs),
            "capture_seconds": None if estimate is None else round(estimate.capture_seconds, 2),
            "graph_memory_gib": None if estimate is None else round(estimate.graph_memory_gib, 3),
            "calibration": cost.name,
            "basis": basis.note,
        }
        typer.echo(_dumps(data, indent=2))
    else:
        sys.stdout.write(render_show(loaded, str(plan), cost.estimate_line(loaded)))


@app.command("dispatch")
@_errors_to_exit
def dispatch_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    reqs: Annotated[int | None, typer.Option("--reqs", help="Requests in the batch.")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", help="Tokens scheduled in the batch.")] = None,
    loras: Annotated[int, typer.Option("--loras", help="Distinct LoRA adapters in the batch.")] = 0,
    base: Annotated[bool, typer.Option("--base", help="Some requests use no adapter (base model).")] = False,
    uniform: Annotated[
        int | None,
        typer.Option("--uniform", help="Uniform tokens per request. Default: derived as vLLM does."),
    ] = None,
    max_query_len: Annotated[
        int | None,
        typer.Option(
            "--max-query-len",
            help="Longest request in tokens. Default: ceil(tokens / reqs), the most even batch.",
        ),
    ] = None,
    has_prefill: Annotated[
        bool,
        typer.Option("--has-prefill", help="The batch holds a real prefill chunk (from vLLM 0.28: no decode graph)."),
    ] = False,
    queries: Annotated[
        Path | None,
        typer.Option(
            "--queries",
            help="A batch file, the format simulate reads: JSON lines {num_reqs, num_tokens, "
            "max_query_len?, num_active_loras?, base?, has_prefill?, uniform_token_count?, count?}; "
            "prints one descriptor object per line, in order.",
        ),
    ] = None,
    encoder_items: Annotated[
        str | None,
        typer.Option(
            "--encoder-items",
            help="Instead of a batch: one encoder batch, the output tokens of each item (image, video), "
            "comma-separated, e.g. 300,1200,40; prints how vLLM packs it onto the plan's encoder graphs.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the descriptor as a JSON object.")] = False,
) -> None:
    """Which captured graph serves a batch (or eager), and why."""
    from capplan.batches import batch_from_args, read_batches
    from capplan.loading import load_plan
    from capplan.planner.dispatch import Dispatcher
    from capplan.schemas.plan import address

    if encoder_items is not None:
        if reqs is not None or tokens is not None or queries is not None:
            raise UsageError("--encoder-items asks about an encoder batch; give it without --reqs/--tokens/--queries")
        _encoder_dispatch(load_plan(plan), encoder_items, as_json)
        return
    if queries is not None:
        if reqs is not None or tokens is not None:
            raise UsageError("--queries replaces --reqs/--tokens; give one or the other")
        loaded = load_plan(plan)
        batches = read_batches(queries, loaded.spec).batches
        dispatcher = Dispatcher(loaded)
        for item in batches:
            sys.stdout.write(_dumps(dispatcher.dispatch(item.batch).descriptor()) + "\n")
        return
    if reqs is None or tokens is None:
        raise UsageError("give --reqs and --tokens (or --queries FILE.jsonl)")
    loaded = load_plan(plan)
    batch = batch_from_args(reqs, tokens, max_query_len, loras, base, has_prefill, uniform, loaded.spec)
    dispatcher = Dispatcher(loaded)
    trace: list[str] = []
    desc = dispatcher.explain(batch, trace)
    if as_json:
        typer.echo(_dumps(desc.descriptor()))
        return
    if desc.cg_mode == "NONE":
        typer.echo(f"eager (cg_mode NONE): {batch.num_tokens} tokens, no graph replay")
    else:
        padding = desc.num_tokens - batch.num_tokens
        typer.echo(
            f"graph {address(desc)}: {desc.cg_mode} num_tokens={desc.num_tokens} "
            f"num_reqs={desc.num_reqs} uniform_token_count={desc.uniform_token_count} "
            f"num_active_loras={desc.num_active_loras} (pads {padding} token(s))"
        )
    for line in trace:
        typer.echo(f"  - {line}")


def _packing_caveat(plan) -> str:
    """The releases this plan runs on that pack encoder batches otherwise (an alias's older ones)."""
    from capplan.releases import RELEASES, runs_on

    defers = plan.spec.rules.encoder_packing_defers
    other = [v for v in runs_on(plan.spec.target.vllm) if RELEASES[v].rules.encoder_packing_defers != defers]
    if not other:
        return ""
    how = "never starts a new batch for a large item early" if defers else "starts a new batch for a large item early"
    return f" (vLLM {', '.join(other)} {how})"


def _encoder_dispatch(plan, items_text: str, as_json: bool) -> None:
    from capplan.planner.encoder import EncoderGraphs, pack
    from capplan.releases import release_of

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
    rows = [
        {"items": idx, "tokens": sum(items[i] for i in idx), "graph": None if b is None else f"ENCODER:{b}"}
        for idx, b in batches
    ]
    if as_json:
        typer.echo(_dumps(rows))
        return
    for idx, b in batches:
        tokens = sum(items[i] for i in idx)
        if b is None:
            typer.echo(f"eager: items {idx} ({tokens} tokens; {why})")
        else:
            typer.echo(f"ENCODER:{b}: items {idx} ({tokens} tokens, pads {b - tokens})")
    if enc.budgets:
        typer.echo(f"  - packing as vLLM {release_of(plan.spec.target.vllm).version} does{_packing_caveat(plan)}")


@app.command("flags")
@_errors_to_exit
def flags_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    form: Annotated[
        str,
        typer.Option(
            "--format",
            help="serve: a `vllm serve` line; python: a `python -m vllm.entrypoints.openai.api_server` line; "
            "json: the arguments as a JSON list (for Kubernetes manifests, Ray, your own scripts).",
        ),
    ] = "serve",
) -> None:
    """Print the vLLM arguments that match PLAN, for launching vLLM without `capplan apply`.

    Scheduler limits, max_loras and the specialize switches, DP (and TP/PP when
    the spec names them), and a --compilation-config with the cudagraph mode and
    the plan's capture sizes. MODEL stands for your model. Speculative decoding
    needs your draft method: the line before says what to add. Then set
    CAPPLAN_PLAN=PLAN in the engine's environment to put the plan in force.
    """
    from capplan.loading import load_plan
    from capplan.runtime.engine_args import render

    if form not in ("serve", "python", "json"):
        raise UsageError(f"--format must be serve, python or json (got {form!r})")
    typer.echo(render(load_plan(plan), form))


@app.command("verify")
@_errors_to_exit
def verify_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Prove the plan free of every failure class in docs/design.md.

    Checks, over every reachable batch (requests 1..max_num_seqs, tokens
    1..max_num_batched_tokens, uniform or mixed, 0..max_loras adapters with and
    without base requests, every DP rank mix): each batch replays a compatible
    graph or an explicit, reported eager fallback; the LoRA grid of the graph
    it replays covers all its kernel slots; every LoRA graph's dummy records
    the LoRA kernels with the right adapter count and no dummy request is too
    long; DP ranks always agree on the padded token count; and the plan is
    exactly what its spec compiles to. Exit 0 when it holds, 1 with one line
    per violation.
    """
    from capplan.analysis.verify import verify_plan
    from capplan.loading import load_plan

    # A loaded plan is the one its spec compiles to (the loader compared them): no second compile.
    report = verify_plan(load_plan(plan), consistency=False)
    if as_json:
        typer.echo(_dumps(report.to_json(), indent=2))
    else:
        for region in report.eager_regions:
            typer.echo(f"eager: {region}")
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
        if report.ok:
            typer.echo(f"ok: {plan} is free of every failure class ({checked} checked)")
    for violation in report.violations:
        typer.echo(f"violation: {violation.line()}", err=True)
    if not report.ok:
        raise typer.Exit(code=1)


@app.command("simulate")
@_errors_to_exit
def simulate_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="Batch trace: JSON lines, or a vLLM batch-size log. Under DP, one trace per rank "
            "(capplan apply --trace writes TRACE.rank0.jsonl, TRACE.rank1.jsonl, ...).",
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write hits and padding per captured size (.svg, or .png with matplotlib)."),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            help="Calibration YAML; when it has step times (capplan calibrate), the total step time is predicted.",
        ),
    ] = None,
) -> None:
    """Replay a batch trace through the plan's dispatcher: hit rate, eager, padding, unused graphs,
    and with a step-time calibration the predicted total step time.

    TRACE has one batch per line, e.g.
    {"num_reqs": 8, "num_tokens": 8, "max_query_len": 1, "num_active_loras": 2, "base": true, "count": 120}
    (num_reqs and num_tokens required; `adapters` is accepted for num_active_loras).
    Every batch must fit the plan's spec (max_num_seqs, max_num_batched_tokens,
    max_loras). A vLLM log with VLLM_LOG_BATCHSIZE_INTERVAL also parses, but it
    is partial: padded token counts only, no requests or adapters, and on MRV2
    no FULL graph replays (vLLM logs only steps through set_forward_context);
    setting the variable at launch crashed FULL graph capture on vLLM 0.25.
    Synthetic traces: examples/traces/.

    With data parallelism, pass one trace per rank: the ranks' steps are
    aligned (by the recorder's dp_step) and run through vLLM's DP sync (padding
    to the largest token count across ranks, the lowest mode wins, idle ranks
    run a dummy batch); counts are per rank. One trace for a DP plan is taken
    to run on every rank, and the output says so.

    Step time is predicted only from points the calibration measured, or that
    lie between two measured points of the same mode and LoRA case (the
    neighbours bound the error); otherwise the points to measure are listed.
    """
    from capplan.batches import read_rank_traces
    from capplan.loading import load_cost_model, load_plan
    from capplan.traffic.simulate import render_simulation, simulate, simulate_ranks

    loaded = load_plan(plan)
    files = read_rank_traces(traces, loaded.spec)
    for note in {f.note for f in files if f.note}:
        typer.echo(f"note: {note}", err=True)
    cost = load_cost_model(calibration)
    if len(files) == 1:
        result = simulate(loaded, files[0].batches, cost=cost)
    else:
        result = simulate_ranks(loaded, [f.batches for f in files], cost=cost)
    data = result.to_json(loaded)
    trace_names = " ".join(str(t) for t in traces)
    if plot is not None:
        from capplan.present.plot import plot_bars, simulation_panels

        caption = (
            f"capplan simulate {plan.name} {' '.join(t.name for t in traces)}: "
            f"hit rate {data['graph_hit_rate']:.1%}, padding {data['padding_overhead']:.2%}"
        )
        inputs = _inputs(plan, *traces, calibration)
        _write_picture(plot, plot_bars(plot, simulation_panels(data), caption), inputs)
    if as_json:
        typer.echo(_dumps(data, indent=2))
    else:
        typer.echo(render_simulation(str(plan), trace_names, loaded, result))


@app.command("optimize")
@_errors_to_exit
def optimize_cmd(
    spec: Annotated[Path, typer.Argument(help="Spec YAML to start from.", show_default=False)],
    traces: Annotated[
        list[Path],
        typer.Argument(help="Batch trace (see capplan simulate --help); under DP, one per rank.", show_default=False),
    ],
    max_graphs: Annotated[
        int | None, typer.Option("--max-graphs", min=1, help="Budget: graphs captured (after pruning).")
    ] = None,
    max_graph_memory: Annotated[
        float | None,
        typer.Option("--max-graph-memory", min=0.0, help="Budget: estimated graph memory in GiB (H200 cost model)."),
    ] = None,
    max_capture_seconds: Annotated[
        float | None,
        typer.Option("--max-capture-seconds", min=0.0, help="Budget: estimated capture time in seconds."),
    ] = None,
    max_slowdown: Annotated[
        float | None,
        typer.Option(
            "--max-slowdown",
            min=0.0,
            max=1000.0,
            help="Budget: the fewest graphs whose predicted step time on the trace stays within PCT percent of "
            "the default plan's, bounds included (the candidate's upper bound against the default's lower).",
        ),
    ] = None,
    objective: Annotated[
        str | None,
        typer.Option(
            "--objective",
            help="step-time (predicted from the calibration's step times; the default when it has them) "
            "or padding (padded tokens; the default otherwise).",
        ),
    ] = None,
    padding_fallback: Annotated[
        bool,
        typer.Option(
            "--padding-fallback",
            help="When step time cannot choose (the calibration lacks prices the trace needs), choose by "
            "padded tokens instead and say so, rather than refusing.",
        ),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Where to write the optimized spec (default: SPEC.optimized.yaml)."),
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the trade-off curve (.svg or .png).")] = None,
    calibration: Annotated[Path | None, typer.Option("--calibration", help="Cost model calibration YAML.")] = None,
    shared_sizes: Annotated[
        bool,
        typer.Option(
            "--shared-sizes", help="One size list for every LoRA case (what plain vLLM can run; always so under DP)."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the curve and the choice as JSON.")] = False,
    full_curve: Annotated[
        bool, typer.Option("--full-curve", help="Print every point of the curve, not only those near the budget.")
    ] = False,
) -> None:
    """Choose capture sizes for a trace under a graph, memory, capture-time or slowdown budget.

    The objective is the trace's predicted total step time when the
    calibration has step times (capplan calibrate, calibrate-trace): every
    candidate plan is compiled and the trace replayed through it; a step costs
    the measured time of what it runs (a FULL or PIECEWISE graph of its padded
    size, or eager), interpolated only between measured sizes of the same mode
    and LoRA case. A candidate whose replay needs an unmeasured price is never
    chosen; when none is left, optimize refuses and names the points to
    measure (or, with --padding-fallback, chooses by padded tokens and says
    so). Without step times the objective is padded tokens, and the largest
    size stays the spec's max capture size.

    Estimates rest on the calibration's model and GPU: a spec that names
    another model (spec `model`, `target.gpu`) gets no estimate-based budget
    or step-time objective from it.

    With LoRA and one DP rank, sizes are chosen per LoRA case
    (cudagraph.lora_case_sizes, run by capplan's runtime): a case the trace
    rarely uses keeps few sizes, always including the largest. The budget is
    split across cases exactly (knapsack over each case's optimal curve).
    Under DP, pass one trace per rank: candidates are scored through DP sync.

    Exact: dynamic programming over the sorted token counts of the trace
    (optimal 1-D bucketing) for every number of sizes. Prints the trade-off
    curve, writes a spec with explicit cudagraph.capture_sizes whose compiled
    plan verifies, and leaves everything else in the spec as it was.
    """
    from capplan.analysis.verify import verify_plan
    from capplan.batches import read_rank_traces
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_cost_model, load_spec
    from capplan.planfile import render_spec
    from capplan.traffic.optimize import optimize, render_curve

    out = output or spec.with_name(spec.name.removesuffix(".yaml").removesuffix(".yml") + ".optimized.yaml")
    inputs = _inputs(spec, *traces, calibration)
    if plot is not None and os.path.realpath(plot) == os.path.realpath(out):
        raise UsageError(f"--plot {printable(str(plot))} is also the optimized spec's path", "give the picture its own")
    for target in (out, plot):
        if target is not None:
            check_output(target, inputs)
    loaded = load_spec(spec)
    files = read_rank_traces(traces, loaded)
    for note in {f.note for f in files if f.note}:
        typer.echo(f"note: {note}", err=True)
    result = optimize(
        loaded,
        [f.batches for f in files],
        load_cost_model(calibration),
        max_graphs=max_graphs,
        max_graph_memory=max_graph_memory,
        max_capture_seconds=max_capture_seconds,
        max_slowdown=max_slowdown,
        shared_sizes=shared_sizes,
        objective=objective,
        padding_fallback=padding_fallback,
    )
    report = verify_plan(result.plan)
    if not report.ok:
        raise CapplanError(
            f"the optimized plan does not verify: {report.violations[0].line()}",
            "please report this; nothing was written",
        )
    p, d = result.point, result.default
    trace_names = " ".join(printable(t.name) for t in traces)
    header = (
        f"# capplan optimize {printable(spec.name)} {trace_names} (budget {result.budget}, "
        f"objective {result.objective})\n"
        f"# {p.sizes} capture sizes, {p.graphs} graphs (default {d.graphs}), padding {p.padding_overhead:.2%} "
        f"of real tokens on the trace (default {d.padding_overhead:.2%})\n"
    )
    if result.objective == "step-time" and p.step_seconds is not None and d.step_seconds is not None:
        header += (
            f"# predicted steps {p.step_seconds:.3f} s (default {d.step_seconds:.3f} s); {printable(result.basis)}\n"
        )
    if result.fallback:
        header += f"# chosen by padded tokens: {printable(result.fallback)}\n"
    picture = None
    if plot is not None:  # drawn before anything is written: a picture that cannot be made writes nothing
        from capplan.present.plot import plot_curve

        caption = (
            f"capplan optimize {spec.name} {' '.join(t.name for t in traces)}: default {d.graphs} graphs, "
            f"padding {d.padding_overhead:.2%}"
        )
        picture = plot_curve(plot, result.curve, p, max_graphs, caption)
    write_atomic(out, header + render_spec(result.spec), inputs)
    if plot is not None and picture is not None:
        _write_picture(plot, picture, inputs)
    if as_json:
        typer.echo(
            _dumps(
                {
                    "output": str(out),
                    "budget": result.budget,
                    "objective": result.objective,
                    "basis": result.basis,
                    "assumption": result.assumption,
                    "padding_fallback": result.fallback,
                    "chosen": p.to_json(),
                    "default": d.to_json(),
                    "curve": [c.to_json() for c in result.curve],
                },
                indent=2,
            )
        )
        return
    typer.echo(render_curve(result, full=full_curve))
    steps = ""
    if result.objective == "step-time" and p.step_seconds is not None:
        steps = f", predicted steps {p.step_seconds:.2f} s" + (
            f" vs {d.step_seconds:.2f} s" if d.step_seconds is not None else " (the default plan is not priced)"
        )
    typer.echo(
        f"wrote {printable(str(out))}: {p.sizes} sizes, {p.graphs} graphs vs {d.graphs} by default, padding "
        f"{p.padding_overhead:.2%} vs {d.padding_overhead:.2%}{steps}; its plan verifies"
    )
    if result.fallback:
        typer.echo(f"chosen by padded tokens, not step time (--padding-fallback): {printable(result.fallback)}")


@app.command("diff")
@_errors_to_exit
def diff_cmd(
    old: Annotated[Path, typer.Argument(help="Old plan (or spec with --spec).", show_default=False)],
    new: Annotated[Path, typer.Argument(help="New plan (or spec with --spec).", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="text | markdown (pastes into a pull request) | json.")] = "text",
    specs: Annotated[
        bool, typer.Option("--spec", help="OLD and NEW are specs: compile both in memory and compare.")
    ] = False,
    calibration: CalibrationOption = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Draw graphs added, removed and kept per capture size and LoRA case (.svg, or .png with "
            "capplan[plot]); link it from the markdown diff.",
        ),
    ] = None,
) -> None:
    """Semantic diff: graphs added/removed per mode and LoRA case, dispatch changes,
    fixes, and the estimated capture time and memory delta.

    Exit 0 when the plans are equal, 2 when they differ, 1 on error.
    """
    from capplan.analysis.diff import render_markdown, render_text

    try:
        result, a, b = _diff(old, new, fmt, specs, calibration)
        if plot is not None:
            from capplan.present.picture import diff_grids
            from capplan.present.plot import plot_plan

            grids, legend = diff_grids(a, b)
            caption = f"capplan diff {old.name} -> {new.name}: {result.headline()}"
            inputs = _inputs(old, new, calibration)
            _write_picture(plot, plot_plan(plot, grids, caption[:150], legend), inputs)
    except UsageError as exc:
        # Exit 2 is this command's answer "the plans differ": a refusal exits 1.
        exc.exit_code = 1
        raise
    if fmt == "json":
        typer.echo(_dumps(result.to_json(), indent=2))
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(result))
    else:
        sys.stdout.write(render_text(result))
    if not result.equal:
        raise typer.Exit(code=2)


def _diff(old: Path, new: Path, fmt: str, specs: bool, calibration: Path | None):
    """Load both sides of `capplan diff` (plans, or specs compiled in memory) and compare them."""
    from capplan.analysis.diff import diff_plans
    from capplan.files import shown
    from capplan.loading import load_cost_model, load_plan

    if fmt not in ("text", "markdown", "json"):
        raise UsageError(f"--format must be text, markdown or json (got {fmt!r})")
    cost = load_cost_model(calibration)

    def load(path: Path):
        try:
            return _compile_spec(path) if specs else load_plan(path)
        except CapplanError as exc:
            return exc

    a, b = load(old), load(new)
    if isinstance(a, CapplanError) or isinstance(b, CapplanError):
        # The likely mix-ups: specs without --spec, plans with it, or one of each.
        def kind(side) -> str:
            if isinstance(side, CapplanError):
                if "but a spec" in side.message:
                    return "spec"
                if "this is a capture plan, not a spec" in side.message:
                    return "plan"
                return "error"
            return "plan" if not specs else "spec"

        kinds = (kind(a), kind(b))
        o, n = shown(old), shown(new)
        if kinds == ("spec", "spec") and not specs:
            raise UsageError(f"{o} is a spec, not a plan", f"compare specs with: capplan diff --spec {o} {n}")
        if kinds == ("plan", "plan") and specs:
            raise UsageError(f"{o} is a plan, not a spec", f"compare plans without --spec: capplan diff {o} {n}")
        if sorted(kinds) == ["plan", "spec"]:
            spec_side = o if kinds[0] == "spec" else n
            plan_side = n if kinds[0] == "spec" else o
            raise UsageError(
                f"{spec_side} is a spec and {plan_side} a plan; diff compares two plans, or two specs with --spec",
                f"compile the spec first (capplan compile {spec_side}) and compare the two plans",
            )
        raise a if isinstance(a, CapplanError) else b
    return diff_plans(a, b, cost, printable(str(old)), printable(str(new))), a, b


GIT_ATTRIBUTE = "*.plan.yaml diff=capplan"


def _this_capplan() -> str:
    """A command that runs this capplan wherever git runs it (another PATH, a GUI, CI)."""
    import shlex

    return f"{shlex.quote(sys.executable)} -m capplan"


@app.command("git-setup")
@_errors_to_exit
def git_setup_cmd(
    command: Annotated[
        str | None,
        typer.Option(
            "--command",
            help="How git runs capplan (default: this capplan, by its Python's absolute path, so git finds it "
            "whatever PATH it runs with).",
        ),
    ] = None,
) -> None:
    """Make `git diff` show plans as `capplan diff` does, in the repository you are in.

    Adds `*.plan.yaml diff=capplan` to the repository's .gitattributes (commit
    it, so every clone knows which files are plans) and sets
    `diff.capplan.command` in this clone's git config (each clone runs this
    once). Then `git diff`, and `git log -p --ext-diff` / `git show --ext-diff`,
    print graphs added and removed per mode and LoRA case, dispatch and spec
    changes for every plan; `git diff --no-ext-diff` shows the raw lines. All
    or nothing: when either step fails, neither is left changed.
    """
    import subprocess

    from capplan.files import read_text, write_atomic

    def git(*args: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise CapplanError("git: command not found", "install git") from None

    top = git("rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise CapplanError(
            f"git rev-parse --show-toplevel: {top.stderr.strip() or 'failed'}",
            "run capplan git-setup inside a git repository",
        )
    root = Path(top.stdout.removesuffix("\n"))  # the path as git has it: a name may end in a space
    attributes = root / ".gitattributes"
    current = ""
    if os.path.lexists(attributes):
        if os.path.islink(attributes):
            raise CapplanError(f"{printable(str(attributes))}: is a symbolic link", "make it a regular file")
        current = read_text(attributes, ".gitattributes file", CapplanError, 1 << 20)
    runs = command if command is not None else _this_capplan()
    if "\n" in runs or not runs.strip():
        raise UsageError("--command must be one line naming how to run capplan")
    value = f"{runs} git-diff --"  # `--`: a plan named -h.plan.yaml is a path, not an option
    before = git("config", "--local", "--get", "diff.capplan.command")
    had = before.stdout.removesuffix("\n") if before.returncode == 0 else None
    setting = git("config", "--local", "diff.capplan.command", value)
    if setting.returncode != 0:
        reason = setting.stderr.strip().splitlines()[0] if setting.stderr.strip() else "failed"
        hint = "nothing was changed"
        if "lock" in reason:
            hint += "; another git process holds the config lock (remove .git/config.lock if none runs)"
        raise CapplanError(f"git config diff.capplan.command: {reason}", hint)

    def undo_config() -> None:
        if had is None:
            git("config", "--local", "--unset", "diff.capplan.command")
        else:
            git("config", "--local", "diff.capplan.command", had)

    added = GIT_ATTRIBUTE not in current.splitlines()
    if added:
        try:
            write_atomic(
                attributes, current + ("" if not current or current.endswith("\n") else "\n") + GIT_ATTRIBUTE + "\n"
            )
        except CapplanError:
            undo_config()
            raise
    # A later line, a folder's own .gitattributes or .git/info/attributes can set another diff
    # for plans, and a worktree's config another command: ask git what it will use, for a new
    # plan at the top and for every plan it tracks.
    tracked = git("-C", str(root), "ls-files", "-z", "--", "*.plan.yaml").stdout.split("\0")
    paths = ["capplan-probe.plan.yaml", *[p for p in tracked if p][:5000]]
    probe = subprocess.run(
        ["git", "-C", str(root), "check-attr", "-z", "diff", "--stdin"],
        input="\0".join(paths) + "\0", capture_output=True, text=True,
    )  # fmt: skip
    fields = probe.stdout.split("\0") if probe.returncode == 0 else []
    found = list(zip(fields[0::3], fields[2::3])) or [("capplan-probe.plan.yaml", "unknown")]
    where, says = next(((p, v) for p, v in found if v != "capplan"), ("", "capplan"))
    effective = git("-C", str(root), "config", "--get", "diff.capplan.command").stdout.removesuffix("\n")
    if says == "capplan" and effective != value:
        undo_config()
        if added:
            if current:
                write_atomic(attributes, current)
            else:
                attributes.unlink()
        raise CapplanError(
            f"git would run `{printable(effective or 'nothing')}` for plans: diff.capplan.command is set where this "
            "clone's config does not reach it (a worktree's config, GIT_CONFIG_* in the environment); nothing was "
            "changed",
            "git config --show-origin --get diff.capplan.command shows where; unset it there",
        )
    if says != "capplan":
        if added:
            if current:
                write_atomic(attributes, current)
            else:
                attributes.unlink()
        undo_config()
        raise CapplanError(
            f"git would diff {printable(where)} with `diff: {printable(says)}`: another attributes line overrides "
            f"`{GIT_ATTRIBUTE}`; nothing was changed",
            f"remove or move that line (git check-attr diff -- {printable(where)} shows what git uses)",
        )
    if added:
        typer.echo(f"added `{GIT_ATTRIBUTE}` to {_relative(attributes, Path.cwd())} (commit it)", err=True)
    typer.echo(
        f"git config diff.capplan.command {printable(value)!r}: git diff now shows plans semantically "
        "(git log -p --ext-diff for history)",
        err=True,
    )


@app.command("git-diff", hidden=True)
def git_diff_cmd(args: Annotated[list[str] | None, typer.Argument()] = None) -> None:
    """git's external diff driver: PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE [...].

    Prints the semantic diff of the two plans; when either side cannot be
    loaded (a plan of another format, say), says why and prints the raw
    unified diff, or says why not when a side cannot be read either. Exits 0,
    as git requires of a diff driver, unless git called it wrongly.
    """
    import difflib

    from capplan.analysis.diff import diff_plans, render_text
    from capplan.errors import InputError
    from capplan.files import read_text
    from capplan.loading import load_cost_model, load_plan

    args = args or []
    if len(args) < 7:
        typer.echo(
            "error: usage: capplan git-diff PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE "
            "(git runs this; see capplan git-setup)",
            err=True,
        )
        raise typer.Exit(code=2)
    path, old_file, new_file = printable(args[0]), Path(args[1]), Path(args[4])
    new_path = printable(args[7]) if len(args) > 7 else path  # a rename: git appends the new name
    if str(old_file) == os.devnull or str(new_file) == os.devnull:
        which = "new" if str(old_file) == os.devnull else "deleted"
        side = new_file if which == "new" else old_file
        try:
            sys.stdout.write(f"capplan diff b/{new_path}: {which} plan: {_summary(load_plan(side))}\n")
        except CapplanError as exc:
            sys.stdout.write(f"capplan diff b/{new_path}: {which} file, not a loadable plan ({exc.one_line()})\n")
        return
    try:
        old, new = load_plan(old_file), load_plan(new_file)
    except CapplanError as exc:
        try:
            old_text = read_text(old_file, "plan file", InputError)
            new_text = read_text(new_file, "plan file", InputError)
        except CapplanError as unreadable:
            sys.stdout.write(f"capplan diff a/{path} b/{new_path}: not compared ({unreadable.one_line()})\n")
            return
        sys.stdout.write(
            f"capplan diff a/{path} b/{new_path}: not compared semantically ({exc.one_line()}); raw diff:\n"
        )
        old_lines = [printable(line) + "\n" for line in old_text.splitlines()]
        new_lines = [printable(line) + "\n" for line in new_text.splitlines()]
        sys.stdout.writelines(difflib.unified_diff(old_lines, new_lines, f"a/{path}", f"b/{new_path}"))
        return
    result = diff_plans(old, new, load_cost_model(None), f"a/{path}", f"b/{new_path}")
    sys.stdout.write(render_text(result))


@app.command(
    "apply",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@_errors_to_exit
def apply_cmd(
    ctx: typer.Context,
    plan: Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)],
    runner: Annotated[str, typer.Option("--runner", help="Model runner: mrv2.")] = "mrv2",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check the command's flags against the plan and print the command that would run, with the "
            "flags the plan adds; start nothing.",
        ),
    ] = False,
    report: Annotated[
        Path | None,
        typer.Option(
            "--report",
            help="Write the end-of-run report as JSON here; {pid} and {rank} "
            "(the DP rank) are filled in, so each process of a DP launch writes its own.",
        ),
    ] = None,
    smoke: Annotated[
        Path | None,
        typer.Option(
            "--smoke",
            help="Instead of a command: build the plan's engine on DIR (base/ plus LoRA "
            "adapter folders), generate LoRA batches with graphs and eager, compare. Needs a GPU.",
        ),
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Max |logprob| difference for --smoke.")] = 0.1,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Record every step's batch here as JSON lines, the format simulate and optimize read "
            "(same as CAPPLAN_TRACE=PATH). {rank} is filled in; with DP > 1 each rank writes its own "
            "file. Stops at CAPPLAN_TRACE_MAX_MB (default 256).",
        ),
    ] = None,
) -> None:
    """Run a vLLM command with PLAN in force: capplan apply --runner mrv2 PLAN -- vllm serve MODEL ...

    For `vllm serve` and `python -m vllm.entrypoints.openai.api_server`, the
    flags are read first: one that contradicts the plan (max_loras, max_num_seqs,
    capture sizes, cudagraph mode, ...) is refused before anything starts, and
    what the plan determines and the command leaves out is added (printed on one
    line), so `capplan apply --runner mrv2 PLAN -- vllm serve MODEL` is a
    complete launch. Any other command that starts vLLM works too (python
    my_script.py), checked by each engine instead. vLLM
    loads capplan's plugin (entry point vllm.general_plugins) in every engine
    and worker process, and CAPPLAN_PLAN names the plan. Setting
    CAPPLAN_PLAN=PATH yourself does the same without this wrapper.
    """
    import shlex

    from capplan.loading import load_plan

    if runner != "mrv2":
        raise UsageError(f"--runner must be mrv2 (got {runner!r})")
    command = list(ctx.args)
    if smoke is not None:
        from capplan.runtime.smoke import run_smoke

        if command:
            raise UsageError("--smoke runs its own engines: give no command")
        passed, text = run_smoke(plan, smoke, tolerance)
        typer.echo(text)
        raise typer.Exit(code=0 if passed else 1)
    if not command:
        raise UsageError("give the command to run after --, e.g. capplan apply --runner mrv2 PLAN -- vllm serve MODEL")
    loaded = load_plan(plan)  # refuse a bad plan before starting anything
    from capplan.runtime.engine_args import prepare
    from capplan.runtime.launch import check_environment, run_child

    command, notes = prepare(loaded, str(plan), command)  # a flag against the plan: refused here, in well under 1 s
    if dry_run:
        for line in notes:
            typer.echo(line, err=True)
        typer.echo(shlex.join(command))
        return
    _check_run_outputs(plan, command, report, trace, loaded.dp.data_parallel_size)

    env = check_environment(command, dict(os.environ), loaded.spec.target.vllm)
    env["CAPPLAN_PLAN"] = str(plan.resolve())
    if report is not None:
        env["CAPPLAN_REPORT"] = str(report.resolve())
    if trace is not None:
        env["CAPPLAN_TRACE"] = str(trace.resolve())
    for line in notes:
        typer.echo(line, err=True)
    typer.echo(f"capplan: running with {plan} ({len(loaded.graphs)} graphs): {shlex.join(command)}", err=True)
    before = _reports(report) if report is not None else {}
    code = run_child(command, env)
    if report is not None and code == 0 and not set(_reports(report).items()) - set(before.items()):
        raise CapplanError(
            f"{printable(str(report))} was never written: the plan was not put in force by any engine of this command",
            "check that the command starts vLLM with Model Runner V2",
        )
    raise typer.Exit(code=code)


def _reports(report: Path) -> dict[str, tuple[int, int]]:
    """The report files the template names now, each with (inode, mtime): a report this run
    wrote is a new file (the runtime replaces the file, so its inode changes)."""
    import glob

    found = {}
    for name in glob.glob(glob.escape(str(report)).replace("{rank}", "*").replace("{pid}", "*")):
        try:
            info = os.stat(name)
        except OSError:
            continue
        found[name] = (info.st_ino, info.st_mtime_ns)
    return found


def _check_run_outputs(plan: Path, command: list[str], report: Path | None, trace: Path | None, ranks: int) -> None:
    """--report and --trace are outputs: for every DP rank, never the plan, a file of the
    command (`FILE` or `--opt=FILE`), each other, a symlink, or a file in a folder that
    cannot be written."""
    import glob

    from capplan.files import check_output
    from capplan.runtime.recorder import trace_path

    words = [part for a in command for part in (a, a.split("=", 1)[-1])]
    inputs = [plan, *(Path(w) for w in words if os.path.isfile(w))]
    files: dict[str, set[str]] = {}
    import re

    for option, path in (("--report", report), ("--trace", trace)):
        if path is None:
            continue
        if os.path.islink(path):  # the engine gets the resolved path: refuse the link itself
            raise UsageError(f"{option} {printable(str(path))}: is a symbolic link; give the real path")
        if option == "--trace":
            names = {trace_path(str(path), r, ranks) for r in range(ranks)}
        else:
            names = {str(path).replace("{rank}", str(r)) for r in range(ranks)}
        if "{pid}" in str(path):  # any existing file the pattern can name (a pid is digits)
            pattern = re.compile(re.escape(os.path.abspath(path)).replace(re.escape("{pid}"), "[0-9]+") + "$")
            found = glob.glob(glob.escape(str(path)).replace(glob.escape("{pid}"), "*"))
            names |= {n for n in found if pattern.match(os.path.abspath(n))}
        for name in names:
            folder = Path(name.replace("{pid}", "0")).resolve().parent
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise UsageError(f"{option} {printable(str(path))}: {printable(str(folder))} is not a writable folder")
        files[option] = {os.path.abspath(n) for n in names}
        for name in sorted(names):
            try:
                check_output(Path(name), inputs)
            except CapplanError as exc:
                raise UsageError(f"{option}: {exc.message}", exc.hint) from None
    if report is not None and trace is not None:  # the same file for one rank and one process?
        marker = "@capplan-pid@"
        by_trace = {os.path.abspath(trace_path(str(trace).replace("{pid}", marker), r, ranks)) for r in range(ranks)}
        by_report = {
            os.path.abspath(str(report).replace("{rank}", str(r)).replace("{pid}", marker)) for r in range(ranks)
        }
        files["--trace"] |= by_trace
        files["--report"] |= by_report
    if len(files) == 2 and files["--report"] & files["--trace"]:
        shared = sorted(files["--report"] & files["--trace"])[0]
        raise UsageError(f"--report and --trace name one file ({printable(shared)})", "give each its own")


@app.command("calibrate")
@_errors_to_exit
def calibrate_cmd(
    spec: Annotated[Path, typer.Argument(help="Spec YAML of the deployment to measure.", show_default=False)],
    model: Annotated[
        Path,
        typer.Option("--model", help="Model folder: the base model in MODEL/base, LoRA adapters in sibling folders."),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Calibration YAML to write.")],
    name: Annotated[str | None, typer.Option("--name", help="Calibration name (default: GPU, vLLM, model).")] = None,
) -> None:
    """Measure capture cost and step times on this machine's GPU, through vLLM, into a calibration file.

    Builds three engines from SPEC, each in its own process with a plan in
    force: the spec's own plan (capture cost; decode step time replaying each
    measured size, per LoRA case), a plan of the smallest size only (capture
    cost of a few graphs; eager decode step times) and a plan of every fourth
    size with LoRA off (capture cost). Pass the file to show, diff, simulate
    and optimize with --calibration; optimize then minimizes predicted step
    time. Needs a GPU and vLLM; extra LLM(...) keywords come from the JSON
    object in CAPPLAN_SMOKE_LLM_ARGS. Takes a few minutes.
    """
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_spec
    from capplan.runtime.calibrate import calibrate

    check_output(output, (spec,))
    loaded = load_spec(spec)
    text, data = calibrate(loaded, spec.name, model, name)
    write_atomic(output, text, (spec,))
    typer.echo(
        f"wrote {printable(str(output))}: {len(data['runs'])} capture runs, {len(data['step_times'])} step times "
        f"(calibration {data['name']})"
    )


@app.command("calibrate-trace")
@_errors_to_exit
def calibrate_trace_cmd(
    plan: Annotated[Path, typer.Argument(help="The plan the trace was recorded under.", show_default=False)],
    trace: Annotated[
        Path, typer.Argument(help="Trace recorded by capplan apply --trace (with step times).", show_default=False)
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Calibration YAML to write.")],
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration", help="Calibration whose capture runs (and step times outside the trace) to keep."
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Calibration name (default: the base's, + served).")
    ] = None,
) -> None:
    """Fit step times as served from a recorded trace, into a calibration file. No GPU needed.

    The interval between two recorded steps is the second step's period as the
    engine ran it (scheduling and output included); intervals over 0.1 s are
    idle time. Steps are dispatched through PLAN: graph steps give the time of
    a FULL or PIECEWISE replay per LoRA case and padded size, eager steps the
    time per token count. Medians of at least 3 steps become the calibration's
    step_times. Without --calibration the file holds what the trace covers and
    nothing more (no capture runs, no other step times); with it, its capture
    runs, its identity and its step times for token counts the trace never
    reached (eager decode, say) are kept.
    """
    import yaml

    from capplan.batches import read_batches
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_calibration, load_plan
    from capplan.traffic.cost import fit_step_times, merge_step_times

    inputs = _inputs(plan, trace, calibration)
    check_output(output, inputs)
    loaded = load_plan(plan)
    batch_file = read_batches(trace, loaded.spec)
    if batch_file.times is None:
        raise InputError(
            f"{printable(str(trace))}: has no step times (t) on every line",
            "record the trace with capplan apply --trace, or CAPPLAN_TRACE",
        )
    times = batch_file.times
    if any(item.dp_step is not None for item in batch_file.batches):
        raise InputError(
            f"{printable(str(trace))}: a DP rank's trace (dp_step): its step times depend on the other ranks' "
            "batches, which one rank's trace does not hold",
            "fit step times from a recording with data_parallel_size 1",
        )
    for i, (item, stamp) in enumerate(zip(batch_file.batches, times)):
        if item.count != 1:
            raise InputError(
                f"{printable(str(trace))}: a line with t has count {item.count}; a recorded step is one line"
            )
        if i and stamp < times[i - 1]:
            raise InputError(
                f"{printable(str(trace))}: t goes back from {times[i - 1]} to {stamp} at batch {i + 1}",
                "a trace is one recording: fit each recording's file on its own",
            )
    if name is not None and (len(name) > 200 or not name.isprintable()):
        raise UsageError("--name: at most 200 printable characters")
    base = load_calibration(calibration) if calibration is not None else None
    if base is not None:
        from capplan.traffic.cost import fit_cost_model, judge

        fit_cost_model(base)  # a base no other command can use is refused here, not in the file written
        basis = judge(base, loaded.spec)
        if not basis.usable:
            raise InputError(
                f"{printable(str(calibration))}: {basis.note}; the trace was recorded under {printable(plan.name)}",
                "pass a calibration of the model and GPU the trace was recorded on, or none",
            )
    fitted = fit_step_times(loaded, batch_file.batches, times)
    if not fitted:
        raise InputError(f"{printable(str(trace))}: too few busy steps to fit (need 3 per size)")
    data: dict = {}
    if base is not None:
        rows = merge_step_times(base.step_times, fitted)
        data = {"name": name or f"{base.name[:190]}+served"}
        if base.identity is not None:
            data["identity"] = base.identity.model_dump(exclude_none=True)
        data |= {"runs": [r.model_dump() for r in base.runs], "step_times": [r.model_dump() for r in rows]}
        source = (
            f"# runs and identity: from {printable(base.name)}. step_times: {len(fitted)} fitted from the trace "
            f"({len(batch_file.batches)} steps), {len(rows) - len(fitted)} kept from {printable(base.name)}.\n"
        )
    else:
        rows = fitted
        data = {"name": name or f"{printable(trace.stem)[:150]}+served"}
        spec = loaded.spec
        if spec.model is not None or spec.target.gpu:
            identity: dict = {}
            if spec.model is not None:
                identity["model"] = spec.model.model_dump(exclude_none=True)
            if spec.target.gpu:
                identity["gpu"] = spec.target.gpu
            data["identity"] = identity
        data["step_times"] = [r.model_dump() for r in rows]
        source = (
            f"# step_times: {len(fitted)} fitted from the trace ({len(batch_file.batches)} steps), nothing else: "
            "no capture runs (pass --calibration to keep a calibration's);\n"
            "# identity: "
            + (
                "the model and GPU the plan's spec names."
                if "identity" in data
                else "not recorded (the spec names no model)."
            )
            + "\n"
        )
    header = (
        f"# Calibration written by capplan calibrate-trace {printable(plan.name)} {printable(trace.name)}\n" + source
    )
    from capplan.traffic.cost import Calibration

    Calibration.model_validate(data)  # what is written loads: a failure here is capplan's bug, said as one
    write_atomic(output, header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120), inputs)
    typer.echo(
        f"wrote {printable(str(output))}: {len(fitted)} step times fitted from {printable(str(trace))}, "
        f"{len(rows) - len(fitted)} kept"
    )


@app.command("schema")
@_errors_to_exit
def schema_cmd() -> None:
    """Print the spec's JSON Schema (for editor completion and validation)."""
    from capplan.schemas.spec import Spec

    typer.echo(_dumps(Spec.model_json_schema(), indent=2))


def main() -> None:  # pragma: no cover - console entry point
    from typer._click import exceptions as click_exceptions  # the click typer runs on

    global _DEBUG
    argv = sys.argv[1:]
    # --debug is global: accepted before or after the subcommand (not after `--`,
    # where apply's command begins).
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" in argv[:end]:
        _DEBUG = True
        argv = [a for i, a in enumerate(argv) if not (a == "--debug" and i < end)]
    try:
        code = app(args=argv, prog_name="capplan", standalone_mode=False)
    except click_exceptions.UsageError as exc:
        # One line, as every other error: which command, what is wrong, where the help is.
        # Exit 2 (bad usage), but 1 for diff, whose 2 means "the plans differ".
        where = exc.ctx.command_path if exc.ctx is not None else "capplan"
        if type(exc).__name__ == "NoArgsIsHelpError":  # `capplan` alone: the help, as it always was
            typer.echo(exc.format_message(), err=True)
        else:
            typer.echo(f"error: {printable(exc.format_message())} (see {where} --help)", err=True)
        raise SystemExit(1 if exc.ctx is not None and exc.ctx.info_name == "diff" else 2) from None
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        raise SystemExit(130) from None
    except BrokenPipeError:
        # The reader went away (`capplan dispatch ... | head -1`): stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(128 + 13) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
