"""`capplan apply`: run a command that starts vLLM with a plan in force (or the GPU smoke test)."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from capplan.calibration.budget import GIB, MAX_MARGIN_GIB, default_margin_bytes, plan_starts, reading_bytes
from capplan.commands import Notes, no_notes
from capplan.errors import CapplanError, UsageError, printable
from capplan.schemas.plan import Plan


@dataclass(frozen=True)
class ApplyRequest:
    """`capplan apply`'s arguments: the plan, the runner, the command to run, and what to record."""

    plan: Path
    command: list[str]
    runner: str = "mrv2"
    dry_run: bool = False
    report: Path | None = None
    smoke: Path | None = None
    tolerance: float = 0.1
    trace: Path | None = None
    calibration: Path | None = None
    graph_margin: float | None = None
    step_pause_ms: float | None = None  # deferred capture's bounds (plans with tiers)
    slow_capture_every_steps: int | None = None


@dataclass(frozen=True)
class Applied:
    """How the run ended: the child's exit code, or the smoke test's verdict and text."""

    code: int
    text: str | None = None


def apply(request: ApplyRequest, notes: Notes = no_notes) -> Applied:
    """Run the command with CAPPLAN_PLAN set (the plan checked first); a run that exits 0
    without writing the report it promised is refused."""
    import shlex

    from capplan.planfile.read import load_plan

    r = request
    if r.runner != "mrv2":
        raise UsageError(f"--runner must be mrv2 (got {r.runner!r})")
    if r.smoke is not None:
        from capplan.offline.smoke import run_smoke

        if r.command:
            raise UsageError("--smoke runs its own engines: give no command")
        passed, text = run_smoke(r.plan, r.smoke, r.tolerance)
        return Applied(0 if passed else 1, text)
    if not r.command:
        raise UsageError("give the command to run after --, e.g. capplan apply --runner mrv2 PLAN -- vllm serve MODEL")
    loaded = load_plan(r.plan)  # refuse a bad plan before starting anything
    from capplan.envvars import CALIBRATION, COMMAND, GRAPH_MARGIN
    from capplan.launcher.cmdline import server_start
    from capplan.launcher.engine_args import prepare
    from capplan.launcher.launch import check_environment, run_child

    budget = calibration_notes(loaded, r.calibration, r.graph_margin)  # a bad calibration: refused here
    pauses = pause_settings(loaded, r.step_pause_ms, r.slow_capture_every_steps)
    if r.dry_run:
        if sys.stderr.isatty():  # a person waits for one import of vLLM; a log gets only the verdict
            notes("capplan: reading the command with vLLM's own argument parser (one import of vLLM, some seconds)...")
        command, said = prepare(loaded, str(r.plan), r.command)
        for line in [*said, *budget, *pause_note(pauses)]:
            notes(line)
        return Applied(0, shlex.join(command))
    # No import of vLLM here: the server process reads its own command with vLLM's parser
    # (runtime.launch_line), before any engine process starts or weight loads.
    command = list(r.command)
    check_run_outputs(r.plan, command, r.report, r.trace, loaded.spec.parallel.data_parallel_size)
    env = check_environment(command, dict(os.environ), loaded.spec.target.vllm)
    env["CAPPLAN_PLAN"] = str(r.plan.resolve())
    said = []
    if server_start(command) is not None:
        env[COMMAND] = json.dumps(command)
        said.append(
            "capplan: the server reads its flags with vLLM's own parser and checks them against the plan before any "
            "weight loads (what the plan adds is logged there; --dry-run prints the completed line)"
        )
    else:
        said.append(
            "capplan: not a `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command: its flags are "
            "not read here (each engine still checks the plan before it captures)"
        )
    if r.calibration is not None:
        env[CALIBRATION] = str(r.calibration.resolve())
        if r.graph_margin is not None:
            env[GRAPH_MARGIN] = repr(r.graph_margin)
    said += [*budget, *pause_note(pauses)]
    env.update(pauses)
    if r.report is not None:
        env["CAPPLAN_REPORT"] = str(r.report.resolve())
    if r.trace is not None:
        env["CAPPLAN_TRACE"] = str(r.trace.resolve())
    for line in said:
        notes(line)
    notes(f"capplan: running with {r.plan} ({len(loaded.graphs)} graphs): {shlex.join(command)}")
    before = reports(r.report) if r.report is not None else {}
    code = run_child(command, env)
    if r.report is not None and code == 0 and not set(reports(r.report).items()) - set(before.items()):
        raise CapplanError(
            f"{printable(str(r.report))} was never written: the plan was not put in force by any engine of this "
            "command",
            "check that the command starts vLLM with Model Runner V2",
        )
    return Applied(code)


def pause_settings(plan: Plan, step_pause_ms: float | None, slow_every: int | None) -> dict[str, str]:
    """The environment that gives the engine the operator's bounds on deferred capture's step
    pauses; UsageError for a value out of range, or for a plan that defers nothing."""
    from capplan.runtime.deferred.pauses import SLOW_EVERY, STEP_PAUSE_MS, pause_problem

    options = (("--step-pause-ms", step_pause_ms), ("--slow-capture-every-steps", slow_every))
    given = [flag for flag, value in options if value is not None]
    if not given:
        return {}
    if plan.tiers is None:
        raise UsageError(f"{given[0]} bounds deferred capture, and this plan defers no graph (its spec has no tiers)")
    problem = pause_problem(step_pause_ms, slow_every)
    if problem is not None:
        raise UsageError(problem)
    env = {STEP_PAUSE_MS: repr(step_pause_ms)} if step_pause_ms is not None else {}
    return env | ({SLOW_EVERY: str(slow_every)} if slow_every is not None else {})


def pause_note(env: dict[str, str]) -> list[str]:
    """The line that says the bounds `pause_settings` passes (none when the defaults stay)."""
    from capplan.runtime.deferred.pauses import Pauses

    if not env:
        return []
    pauses = Pauses.from_env(env)
    every = pauses.slow_every_steps
    spaced = f"at most {pauses.slow_burst} in a row, then once in {every} steps" if every else "never (idle turns only)"
    return [
        f"capplan: deferred capture: a step waits on a capture expected to take at most {pauses.step_pause_s * 1000:g} "
        f"ms; a longer one, of a graph the traffic missed, {spaced}"
    ]


def calibration_notes(plan: Plan, calibration: Path | None, margin: float | None) -> list[str]:
    """What --calibration will do for this plan, said before the launch (the engine decides,
    against the deployment it finds); UsageError or InputError for a calibration that cannot
    be read or a margin out of range."""
    import math

    from capplan.loading import load_calibration
    from capplan.releases import RELEASES, runs_on

    if calibration is None:
        if margin is not None:
            raise UsageError("--graph-margin needs --calibration: the margin is added to the graph memory it measured")
        return []
    if margin is not None and not (math.isfinite(margin) and 0 <= margin <= MAX_MARGIN_GIB):
        raise UsageError(f"--graph-margin must be between 0 and {MAX_MARGIN_GIB:g} GiB (got {margin})")
    from capplan.calibration.starts import merged_folder

    cal = merged_folder(calibration) if calibration.is_dir() else load_calibration(calibration)
    name = printable(str(calibration))
    if cal is None:
        return [
            f"capplan: {name}: the folder holds no calibration with starts: vLLM's own profiling sizes the KV cache"
        ]
    releases = runs_on(plan.spec.target.vllm)
    if not any(RELEASES[v].profiling_capture for v in releases):
        return [
            f"capplan: {name}: vLLM {', '.join(releases)} sizes the KV cache without a graph-memory estimate (no "
            "profiling capture to skip): vLLM's own sizing stays in charge"
        ]
    if plan.tiers is not None:
        return [f"capplan: {name}: the plan defers graphs (tiers): deferred capture sizes its own reserve"]
    mine, why = plan_starts(plan, cal)
    if why is not None:
        return [f"capplan: {name}: {why}: vLLM's own profiling capture sizes the KV cache"]
    top = max(s.graph_memory_gib for s in mine)
    measured = reading_bytes(top)
    m = (default_margin_bytes(measured) if margin is None else round(margin * GIB)) / GIB
    return [
        f"capplan: {name}: {len(mine)} start(s) of this plan, their capture run first, measured up to {top:.4f} GiB "
        f"of graphs; the engine leaves {measured / GIB + m:.4f} GiB ({m:.4f} GiB margin) beside the KV cache and "
        "skips vLLM's profiling capture where its GPU, release, torch, model shape, parallel sizes and LoRA rank "
        "are the "
        "calibration's"
    ]


def reports(report: Path) -> dict[str, tuple[int, int]]:
    """The report files the template names now, each with (inode, mtime): a report this run
    wrote is a new file (the runtime replaces the file, so its inode changes)."""
    found = {}
    for name in glob.glob(glob.escape(str(report)).replace("{rank}", "*").replace("{pid}", "*")):
        try:
            info = os.stat(name)
        except OSError:
            continue
        found[name] = (info.st_ino, info.st_mtime_ns)
    return found


def check_run_outputs(plan: Path, command: list[str], report: Path | None, trace: Path | None, ranks: int) -> None:
    """--report and --trace are outputs: for every DP rank, never the plan, a file of the
    command (`FILE` or `--opt=FILE`), each other, a symlink, or a file in a folder that
    cannot be written."""

    from capplan.files import check_output
    from capplan.runtime.recorder import trace_path

    words = [part for a in command for part in (a, a.split("=", 1)[-1])]
    inputs = [plan, *(Path(w) for w in words if os.path.isfile(w))]
    files: dict[str, set[str]] = {}
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
