"""The `capplan` command: parse, call one command of `capplan.commands`, render the
result with `capplan.present`, map errors to exit codes.

Data goes to stdout, diagnostics to stderr. Library errors become one line and an
exit code here, in one place: 1 for bad input, 2 for usage errors (see
`capplan.errors`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from capplan import cli_help as h
from capplan.errors import CapplanError, UsageError, printable
from capplan.present.jsondoc import dumps

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
F = TypeVar("F", bound=Callable[..., Any])


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


def _errors_to_exit(fn: F) -> F:
    """Map library errors to `error: ...` on stderr and an exit code; no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CapplanError as exc:
            if _DEBUG:
                raise
            for line in exc.earlier:
                typer.echo(f"error: {line}", err=True)
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

    return wrapper  # type: ignore[return-value]


def _note(line: str) -> None:
    """A command's diagnostic, on stderr as it happens."""
    typer.echo(line, err=True)


def _echo_lines(lines: list[str], err: bool = False) -> None:
    for line in lines:
        typer.echo(line, err=err)


@app.command("compile", help=h.COMPILE_HELP)
@_errors_to_exit
def compile_cmd(
    specs: h.CompileSpecs,
    output: h.CompileOutput = None,
    plan_dir: h.CompilePlanDir = None,
    dry_run: h.CompileDryRun = False,
    as_json: h.CompileAsJson = False,
    check: h.CompileCheck = False,
    skip_non_specs: h.CompileSkipNonSpecs = False,
) -> None:
    from capplan.commands.compile import CompileOptions, compile_specs, refuse_stale, settle
    from capplan.planfile.write import plan_to_json
    from capplan.present.compile import outcome_line

    options = CompileOptions(output, plan_dir, dry_run, check, skip_non_specs)
    outcomes = []
    for job in compile_specs(specs, options, _note):
        if as_json and not check:
            typer.echo(dumps(plan_to_json(job.plan), indent=2))
        outcome = settle(job, options, specs)
        outcomes.append(outcome)
        if outcome.action == "dry run" and not as_json:
            sys.stdout.write(job.text)
        if outcome.action != "stale":
            typer.echo(outcome_line(outcome.action, job.plan_path, job.plan), err=True)
    refuse_stale(outcomes)


@app.command("show", help=h.SHOW_HELP)
@_errors_to_exit
def show_cmd(
    plan: h.PlanFile,
    as_json: h.ShowAsJson = False,
    calibration: h.CalibrationOption = None,
    plot: h.ShowPlot = None,
    full: h.ShowFull = False,
    model_config: h.ModelConfigOption = None,
) -> None:
    from capplan.commands.inspect import show
    from capplan.present.show import render_show, render_show_short, show_json

    shown = show(plan, calibration, plot, model_config)
    if as_json:
        typer.echo(dumps(show_json(shown.plan, shown.priced), indent=2))
    else:
        from capplan.present.show import price_lines

        render = render_show if full else render_show_short
        sys.stdout.write(render(shown.plan, str(plan), "\n  ".join(price_lines(shown.priced))))


@app.command("dispatch", help=h.DISPATCH_HELP)
@_errors_to_exit
def dispatch_cmd(
    plan: h.PlanFile,
    reqs: h.DispatchReqs = None,
    tokens: h.DispatchTokens = None,
    loras: h.DispatchLoras = 0,
    base: h.DispatchBase = False,
    uniform: h.DispatchUniform = None,
    max_query_len: h.DispatchMaxQueryLen = None,
    has_prefill: h.DispatchHasPrefill = False,
    queries: h.DispatchQueries = None,
    encoder_items: h.DispatchEncoderItems = None,
    dp_ranks: h.DispatchDpRanks = None,
    as_json: h.DispatchAsJson = False,
) -> None:
    from capplan.commands.inspect import Answers, DispatchQuestion, Explained, dispatch
    from capplan.present.dispatch import descriptor_lines, encoder_lines, explained_lines

    question = DispatchQuestion(
        plan, reqs, tokens, loras, base, uniform, max_query_len, has_prefill, queries, encoder_items, dp_ranks
    )
    result = dispatch(question)
    if isinstance(result, Explained):
        _echo_lines(explained_lines(result.batch, result.dispatch, result.trace, as_json))
    elif isinstance(result, Answers):
        _echo_lines(descriptor_lines(result.descriptors))
    else:
        lines = encoder_lines(
            result.items, result.batches, result.eager_why, result.has_graphs, as_json, result.packing
        )
        _echo_lines(lines)


@app.command("verify", help=h.VERIFY_HELP)
@_errors_to_exit
def verify_cmd(plan: h.PlanFile, as_json: h.VerifyAsJson = False) -> None:
    from capplan.commands.inspect import verify
    from capplan.present.verify import verify_lines

    report = verify(plan)
    out, err = verify_lines(report, str(plan), as_json)
    _echo_lines(out)
    _echo_lines(err, err=True)
    if not report.ok:
        raise typer.Exit(code=1)


@app.command("simulate", help=h.SIMULATE_HELP)
@_errors_to_exit
def simulate_cmd(
    plan: h.PlanFile,
    traces: h.SimulateTraces,
    as_json: h.SimulateAsJson = False,
    plot: h.SimulatePlot = None,
    calibration: h.SimulateCalibration = None,
    drop_unschedulable: h.DropUnschedulable = False,
    model_config: h.ModelConfigOption = None,
) -> None:
    from capplan.commands.traffic import simulate
    from capplan.present.simulate import render_simulation

    result = simulate(plan, traces, calibration, plot, _note, drop_unschedulable, model_config)
    if as_json:
        typer.echo(dumps(result.data, indent=2))
    else:
        trace_names = " ".join(str(t) for t in traces)
        typer.echo(render_simulation(str(plan), trace_names, result.plan, result.simulation, result.priced))


@app.command("optimize", help=h.OPTIMIZE_HELP)
@_errors_to_exit
def optimize_cmd(
    spec: h.OptimizeSpec,
    traces: h.OptimizeTraces,
    max_graphs: h.OptimizeMaxGraphs = None,
    max_graph_memory: h.OptimizeMaxGraphMemory = None,
    max_capture_seconds: h.OptimizeMaxCaptureSeconds = None,
    max_slowdown: h.OptimizeMaxSlowdown = None,
    objective: h.OptimizeObjective = None,
    padding_fallback: h.OptimizePaddingFallback = False,
    output: h.OptimizeOutput = None,
    plot: h.OptimizePlot = None,
    calibration: h.OptimizeCalibration = None,
    shared_sizes: h.OptimizeSharedSizes = False,
    as_json: h.OptimizeAsJson = False,
    full_curve: h.OptimizeFullCurve = False,
    ready_share: h.OptimizeReadyShare = None,
    max_pad_ratio: h.OptimizeMaxPadRatio = 2.0,
    holdout: h.OptimizeHoldout = 0.2,
    drop_unschedulable: h.DropUnschedulable = False,
    model_config: h.ModelConfigOption = None,
    judge_on: h.OptimizeJudgeOn = None,
) -> None:
    from capplan.commands.traffic import OptimizeRequest, optimize
    from capplan.present.optimize import optimize_json, render_curve, written_lines

    request = OptimizeRequest(
        spec, traces, max_graphs, max_graph_memory, max_capture_seconds, max_slowdown, objective,
        padding_fallback, output, plot, calibration, shared_sizes, ready_share, max_pad_ratio, holdout,
        drop_unschedulable, model_config, tuple(judge_on or ()),
    )  # fmt: skip
    outcome = optimize(request, _note)
    o = outcome
    said = (o.result, o.output, o.ready, o.held_out, o.kept_default, o.judged, o.raise_largest)
    if as_json:
        typer.echo(dumps(optimize_json(*said), indent=2))
        return
    if o.result is not None:
        typer.echo(render_curve(o.result, full_curve, o.held_out, o.kept_default))
    _echo_lines(written_lines(*said))


@app.command("diff", help=h.DIFF_HELP)
@_errors_to_exit
def diff_cmd(
    old: h.DiffOld,
    new: h.DiffNew,
    fmt: h.DiffFmt = "text",
    specs: h.DiffSpecs = False,
    calibration: h.CalibrationOption = None,
    plot: h.DiffPlot = None,
    model_config: h.ModelConfigOption = None,
    policy: h.DiffPolicy = None,
) -> None:
    from capplan.commands.diff import VERDICT_EXIT, diff
    from capplan.present.diff import diff_json, render_markdown, render_text

    result, verdict = diff(old, new, fmt, specs, calibration, plot, model_config, policy)
    said = printable(str(policy)) if policy is not None else ""
    if fmt == "json":
        typer.echo(dumps(diff_json(result, verdict), indent=2))
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(result, verdict, said))
    else:
        sys.stdout.write(render_text(result, verdict, said))
    if verdict is not None:
        if VERDICT_EXIT[verdict.level]:
            raise typer.Exit(code=VERDICT_EXIT[verdict.level])
    elif not result.equal:
        raise typer.Exit(code=2)


@app.command("git-setup", help=h.GIT_SETUP_HELP)
@_errors_to_exit
def git_setup_cmd(command: h.GitSetupCommand = None) -> None:
    from capplan.commands.git_setup import GIT_ATTRIBUTE, git_setup
    from capplan.planfile.paths import relative

    done = git_setup(command)
    if done.added:
        typer.echo(f"added `{GIT_ATTRIBUTE}` to {relative(done.attributes, Path.cwd())} (commit it)", err=True)
    import shlex

    typer.echo(
        "git diff now shows plans semantically (git log -p --ext-diff for history); the setting, as a command: "
        f"git config diff.capplan.command {shlex.quote(printable(done.value))}",
        err=True,
    )


@app.command("git-diff", hidden=True, help=h.GIT_DIFF_HELP)
def git_diff_cmd(args: h.GitDiffArgs = None) -> None:
    from capplan.commands.diff import git_diff

    try:
        result = git_diff(args or [])
    except UsageError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(code=2) from None
    sys.stdout.write(result.text)


@app.command("apply", help=h.APPLY_HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_errors_to_exit
def apply_cmd(
    ctx: typer.Context,
    plan: h.PlanFile,
    runner: h.ApplyRunner = "mrv2",
    dry_run: h.ApplyDryRun = False,
    report: h.ApplyReport = None,
    smoke: h.ApplySmoke = None,
    tolerance: h.ApplyTolerance = 0.1,
    trace: h.ApplyTrace = None,
    calibration: h.ApplyCalibration = None,
    graph_margin: h.ApplyGraphMargin = None,
    step_pause_ms: h.ApplyStepPause = None,
    slow_capture_every_steps: h.ApplySlowEvery = None,
) -> None:
    from capplan.commands.apply import ApplyRequest, apply

    request = ApplyRequest(
        plan,
        list(ctx.args),
        runner,
        dry_run,
        report,
        smoke,
        tolerance,
        trace,
        calibration,
        graph_margin,
        step_pause_ms,
        slow_capture_every_steps,
    )
    applied = apply(request, _note)
    if applied.text is not None:
        typer.echo(applied.text)
    raise typer.Exit(code=applied.code)


@app.command("init", help=h.INIT_HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_errors_to_exit
def init_cmd(
    ctx: typer.Context,
    config: h.InitConfig = None,
    output: h.InitOutput = None,
    vllm: h.InitVllm = None,
    moe: h.InitMoe = None,
    force: h.InitForce = False,
) -> None:
    from capplan.commands.init import InitRequest, init

    done = init(InitRequest(config, list(ctx.args), output, vllm, moe, force), _note)
    if output is None:
        sys.stdout.write(done.text)
        return
    typer.echo(
        f"wrote {printable(str(output))}: {len(done.carried)} setting(s) carried, {len(done.not_carried)} not, "
        f"{len(done.defaults)} at the spec's default, as its header lists ({done.reader})",
        err=True,
    )
    for line in done.not_carried:
        typer.echo(f"  not carried: {printable(line)}", err=True)


@app.command("flags", help=h.FLAGS_HELP)
@_errors_to_exit
def flags_cmd(
    plan: h.PlanOrDeploymentSpec, form: h.FlagsFormat = "serve", calibration: h.FlagsCalibration = None
) -> None:
    from capplan.commands.inspect import deployment_flags, graph_reserve
    from capplan.launcher.engine_args import render
    from capplan.loading import SpecGivenForPlan
    from capplan.planfile.read import load_plan
    from capplan.present.show import reserve_line

    if form not in ("serve", "python", "json", "yaml"):
        raise UsageError(f"--format must be serve, python, json or yaml (got {form!r})")
    try:
        loaded = load_plan(plan)
    except SpecGivenForPlan:  # a spec whose deployment names its vLLM config: that line, completed
        typer.echo(deployment_flags(plan, form))
        return
    typer.echo(render(loaded, form, str(plan)))
    if loaded.spec.deployment is not None:
        typer.echo(
            "# the plan's settings come from its spec's deployment; `capplan flags SPEC` prints the deployment's "
            "own line (every setting it gives) with what the plan adds",
            err=True,
        )
    priced = graph_reserve(plan, loaded, calibration)
    if priced is not None:  # on stderr: the arguments on stdout stay whole for a pipe
        for line in (reserve_line(priced), f"({priced.kind}; {priced.basis})", *priced.notes):
            typer.echo(f"# {line}", err=True)


@app.command(
    "calibrate", help=h.PROBE_HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
@_errors_to_exit
def probe_cmd(
    ctx: typer.Context,
    plan: h.PlanFile,
    model: h.ProbeModel,
    output: h.CalibrateOutput,
    name: h.CalibrateName = None,
    timeout: h.ProbeTimeout = 900,
    keep_log: h.ProbeKeepLog = False,
) -> None:
    from capplan.commands.calibrate import probe

    if not 60 <= timeout <= 86_400:
        raise UsageError(f"--timeout must be 60 to 86400 seconds (got {timeout})")
    done = probe(
        plan,
        model,
        output,
        name,
        tuple(ctx.args),
        float(timeout),
        say=lambda line: typer.echo(line, err=True),
        keep_log=keep_log,
    )
    typer.echo(
        f"wrote {printable(str(output))}: {done.graphs} graphs, {done.capture_seconds:.1f} s capture, "
        f"{done.graph_memory_gib:.4f} GiB graph memory, each capture recorded ({done.seconds:.0f} s from launch; "
        f"report {printable(str(done.report))})"
    )


@app.command("calibrate-steps", help=h.CALIBRATE_HELP)
@_errors_to_exit
def calibrate_cmd(
    spec: h.CalibrateSpec,
    model: h.CalibrateModel,
    output: h.CalibrateOutput,
    name: h.CalibrateName = None,
) -> None:
    from capplan.commands.calibrate import calibrate

    done = calibrate(spec, model, output, name)
    typer.echo(
        f"wrote {printable(str(output))}: {len(done.data['runs'])} capture runs, "
        f"{len(done.data['step_times'])} step times (calibration {done.data['name']})"
    )


@app.command("calibrate-trace", help=h.CALIBRATE_TRACE_HELP)
@_errors_to_exit
def calibrate_trace_cmd(
    plan: h.CalibrateTracePlan,
    trace: h.CalibrateTraceTrace,
    output: h.CalibrateOutput,
    calibration: h.CalibrateTraceCalibration = None,
    name: h.CalibrateTraceName = None,
) -> None:
    from capplan.commands.calibrate import calibrate_trace

    fit = calibrate_trace(plan, trace, output, calibration, name)
    typer.echo(
        f"wrote {printable(str(output))}: {fit.fitted} step times fitted from {printable(str(trace))}, {fit.kept} kept"
    )


@app.command("calibrate-start", help=h.CALIBRATE_START_HELP)
@_errors_to_exit
def calibrate_start_cmd(
    reports: h.CalibrateStartReports,
    plan: h.CalibrateStartPlan,
    output: h.CalibrateOutput,
    model_config: h.CalibrateStartModelConfig = None,
    model: h.CalibrateStartModel = None,
    gpu: h.CalibrateStartGpu = None,
    vllm: h.CalibrateStartVllm = None,
    torch: h.CalibrateStartTorch = None,
    attention_backend: h.CalibrateStartBackend = None,
    lora_rank: h.CalibrateStartRank = None,
    name: h.CalibrateStartName = None,
) -> None:
    from capplan.calibration.starts import Given
    from capplan.commands.calibrate import calibrate_starts

    given = Given(None, model, gpu, vllm, torch, attention_backend, lora_rank)
    done = calibrate_starts(reports, plan, output, given, model_config, name)
    said = f"; given, not measured: {', '.join(done.given)}" if done.given else ""
    typer.echo(f"wrote {printable(str(output))}: {done.starts} start(s){said}")


@app.command("schema", help=h.SCHEMA_HELP)
@_errors_to_exit
def schema_cmd(defaults: h.SchemaDefaults = False) -> None:
    from capplan.schemas.spec import Spec

    if defaults:
        from capplan.present.schema import render_defaults

        sys.stdout.write(render_defaults())
        return
    typer.echo(dumps(Spec.model_json_schema(), indent=2))


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
