"""`capplan calibrate` (measure on a GPU) and `calibrate-trace` (fit step times from a
recorded trace): each writes a calibration file."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capplan.commands import inputs
from capplan.errors import InputError, UsageError, printable

if TYPE_CHECKING:
    from capplan.calibration.starts import Given


@dataclass(frozen=True)
class Calibrated:
    """The calibration written (as data) and where."""

    output: Path
    data: dict[str, Any]


def calibrate(spec: Path, model: Path, output: Path, name: str | None = None) -> Calibrated:
    """Measure capture cost and step times through vLLM on this machine's GPU."""
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_spec
    from capplan.offline.calibrate import calibrate as measure

    check_output(output, (spec,))
    loaded = load_spec(spec)
    text, data = measure(loaded, spec.name, model, name)
    write_atomic(output, text, (spec,))
    return Calibrated(output, data)


@dataclass(frozen=True)
class TraceFit:
    """Step times fitted from a trace: how many were fitted, how many kept from a base calibration."""

    output: Path
    fitted: int
    kept: int


def calibrate_trace(
    plan: Path, trace: Path, output: Path, calibration: Path | None = None, name: str | None = None
) -> TraceFit:
    """Fit step times as served from a trace recorded under `plan`; with `calibration`,
    keep its capture runs, identity and the step times the trace does not cover."""
    from capplan.batches import read_batches
    from capplan.files import check_output, write_atomic
    from capplan.loading import load_checked_calibration
    from capplan.planfile.read import load_plan
    from capplan.traffic.steps import fit_step_times

    sources = inputs(plan, trace, calibration)
    check_output(output, sources)
    loaded = load_plan(plan)
    batch_file = read_batches(trace, loaded.spec)
    times = _check_recording(trace, batch_file)
    if name is not None and (len(name) > 200 or not name.isprintable()):
        raise UsageError("--name: at most 200 printable characters")
    layout = _layout(trace, loaded.spec)
    # a base whose capture runs no command can use is refused here, not in the file written
    base = load_checked_calibration(calibration) if calibration is not None else None
    if base is not None:
        from capplan.calibration.identity import judge

        as_recorded = loaded.spec.model_copy(
            update={"parallel": loaded.spec.parallel.model_copy(update=layout)}
        )  # judged against the layout the trace ran on, not only the one its spec pins
        basis = judge(base, as_recorded)
        if not basis.usable:
            raise InputError(
                f"{printable(str(calibration))}: {basis.note}; the trace was recorded under {printable(plan.name)}",
                "pass a calibration of the model and GPU the trace was recorded on, or none",
            )
    fitted = fit_step_times(loaded, batch_file.batches, times)
    if not fitted:
        raise InputError(f"{printable(str(trace))}: too few busy steps to fit (need 3 per size)")
    steps = len(batch_file.batches)
    if base is not None:
        data, source, kept = _on_base(base, fitted, name, steps, layout)
    else:
        data, source, kept = _alone(loaded.spec, fitted, name, trace, steps, layout)
    header = (
        f"# Calibration written by capplan calibrate-trace {printable(plan.name)} {printable(trace.name)}\n" + source
    )
    write_atomic(output, header + _calibration_yaml(data), sources)
    return TraceFit(output, len(fitted), kept)


def _check_recording(trace: Path, batch_file: Any) -> list[float]:
    """The step times of one recording of one engine (no DP rank), one step a line, in order."""
    if batch_file.times is None:
        raise InputError(
            f"{printable(str(trace))}: has no step times (t) on every line",
            "record the trace with capplan apply --trace, or CAPPLAN_TRACE",
        )
    times: list[float] = batch_file.times
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
    return times


def _layout(trace: Path, spec: Any) -> dict[str, int]:
    """The parallel sizes the trace was recorded at: its header's (the recorder writes the
    engine's), else what its plan's spec pins (the engine check enforced them); a size
    neither says is left out, never taken from a base calibration."""
    from capplan.batches import trace_layout

    layout = {
        name: size
        for name in ("tensor_parallel_size", "pipeline_parallel_size")
        if (size := getattr(spec.parallel, name)) is not None
    }
    return layout | trace_layout(trace)


def _identity_with(identity: dict[str, Any], layout: dict[str, int]) -> dict[str, Any]:
    """An identity whose parallel sizes are the trace's (none where the trace does not say)."""
    kept = {k: v for k, v in identity.items() if k not in ("tensor_parallel_size", "pipeline_parallel_size")}
    return kept | layout


def _on_base(
    base: Any, fitted: list[Any], name: str | None, steps: int, layout: dict[str, int]
) -> tuple[dict[str, Any], str, int]:
    """(data, header lines, step times kept) of the fitted rows merged into a base calibration."""
    from capplan.traffic.steps import merge_step_times

    rows = merge_step_times(base.step_times, fitted)
    data: dict[str, Any] = {"name": name or f"{base.name[:190]}+served"}
    if base.identity is not None or layout:
        identity = base.identity.model_dump(exclude_none=True) if base.identity is not None else {}
        if not identity.get("given"):  # nothing given: the key says nothing, leave it out
            identity.pop("given", None)
        data["identity"] = _identity_with(identity, layout)
    data |= {"runs": [r.model_dump() for r in base.runs], "step_times": [r.model_dump() for r in rows]}
    source = (
        f"# runs and identity: from {printable(base.name)}, parallel sizes the trace's "
        f"({_layout_words(layout)}). step_times: {len(fitted)} fitted from the trace "
        f"({steps} steps), {len(rows) - len(fitted)} kept from {printable(base.name)}.\n"
    )
    return data, source, len(rows) - len(fitted)


def _alone(
    spec: Any, fitted: list[Any], name: str | None, trace: Path, steps: int, layout: dict[str, int]
) -> tuple[dict[str, Any], str, int]:
    """(data, header lines, 0) of the fitted rows alone, with the identity the plan's spec names."""
    data: dict[str, Any] = {"name": name or f"{printable(trace.stem)[:150]}+served"}
    if spec.model is not None or spec.target.gpu or layout:
        identity: dict[str, Any] = {}
        if spec.model is not None:
            identity["model"] = spec.model.model_dump(exclude_none=True)
        if spec.target.gpu:
            identity["gpu"] = spec.target.gpu
        data["identity"] = identity | layout
    data["step_times"] = [r.model_dump() for r in fitted]
    source = (
        f"# step_times: {len(fitted)} fitted from the trace ({steps} steps), nothing else: "
        "no capture runs (pass --calibration to keep a calibration's);\n"
        "# identity: "
        + (
            f"the model and GPU the plan's spec names, parallel sizes the trace's ({_layout_words(layout)})."
            if "identity" in data
            else "not recorded (the spec names no model)."
        )
        + "\n"
    )
    return data, source, 0


def _layout_words(layout: dict[str, int]) -> str:
    if not layout:
        return "not recorded"
    return ", ".join(f"{k} {v}" for k, v in layout.items())


def _calibration_yaml(data: dict[str, Any]) -> str:
    """The calibration's YAML, once it is known to load: a failure here is capplan's bug, said as one."""
    import yaml

    from capplan.schemas.calibration import Calibration

    Calibration.model_validate(data)
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120))


@dataclass(frozen=True)
class StartsCalibrated:
    """A calibration made from start reports: where it went and what it holds."""

    output: Path
    starts: int
    given: tuple[str, ...]


def calibrate_starts(
    reports: list[Path],
    plans: list[Path],
    output: Path,
    identity: Given,
    model_config: Path | None = None,
    name: str | None = None,
) -> StartsCalibrated:
    """One calibration of the deployment from its starts' reports (`capplan apply --report`),
    each checked against the plan it ran (one of PLANS, by fingerprint: starts of several plans
    of one deployment price a changed plan graph by graph and measure scaling's error); the
    identity given (its shape read from `model_config`, a model's config.json) is recorded as
    given. Nothing is written unless every report is accepted."""
    from capplan.calibration.shape import shape_from_config
    from capplan.calibration.starts import calibration_from_starts
    from capplan.files import check_output, write_atomic
    from capplan.planfile.read import load_plan

    sources = inputs(*plans, model_config, *reports)
    check_output(output, sources)
    if name is not None and (not 0 < len(name) <= 200 or not name.isprintable()):
        raise UsageError("--name must be 1 to 200 printable characters")
    if not plans:
        raise UsageError("--plan: give the plan the starts ran")
    for text, option in ((identity.gpu, "--gpu"), (identity.vllm, "--vllm"), (identity.torch, "--torch"),
                         (identity.attention_backend, "--attention-backend"), (identity.model, "--model")):  # fmt: skip
        if text is not None and (not 0 < len(text) <= 200 or not text.isprintable()):
            raise UsageError(f"{option} must be 1 to 200 printable characters")
    if identity.lora_rank is not None and not 1 <= identity.lora_rank <= 1 << 16:
        raise UsageError(f"--lora-rank must be 1 to 65536 (got {identity.lora_rank})")
    loaded = [load_plan(p) for p in plans]
    if model_config is not None:
        identity = replace(identity, shape=shape_from_config(model_config))
    cal = calibration_from_starts(list(reports), loaded, identity, name or output.stem)
    data = cal.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
    data["identity"] = cal.identity.model_dump(mode="json", exclude_none=True) if cal.identity else None
    header = (
        f"# Calibration of one deployment from {len(cal.starts)} start report(s) of "
        f"{', '.join(printable(p.name) for p in plans)} "
        "(capplan calibrate-start).\n"
        "# identity.given: the fields the operator gave, not read from the starts.\n"
    )
    for key in ("runs", "step_times"):
        data.pop(key, None)
    write_atomic(output, header + _calibration_yaml(data), sources)
    return StartsCalibrated(output, len(cal.starts), tuple(cal.identity.given if cal.identity else ()))


@dataclass(frozen=True)
class Probed:
    """A probe's calibration: where it went, the report beside it, and what it measured."""

    output: Path
    report: Path
    graphs: int
    capture_seconds: float
    graph_memory_gib: float
    seconds: float  # from launch to the report's last capture


PROBE_LIMIT_S = 900.0


def probe(
    plan: Path,
    model: Path,
    output: Path,
    name: str | None = None,
    serve_args: tuple[str, ...] = (),
    limit: float = PROBE_LIMIT_S,
    say: Any = print,
    keep_log: bool = False,
) -> Probed:
    """Capture the plan once on this machine's GPU with vLLM's dummy weights: `vllm serve MODEL
    --load-format dummy` under `capplan apply` with CAPPLAN_CAPTURE_EACH=1 (the plan in force,
    completing the line from the plan as apply does; each graph's seconds and pool growth read
    between one graph and the next of vLLM's one capture), stopped once the report says every
    graph is captured. The report is kept beside the calibration (OUTPUT with .report.json), and
    vLLM's log (OUTPUT with .log) on failure or with `keep_log`; the calibration holds its one
    start, each capture's seconds and pool growth, the KV cache vLLM sized, the host and the GPU,
    and its header the start's phases as vLLM logged them (`log_phases`)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    from capplan.calibration.shape import shape_from_config
    from capplan.calibration.starts import Given, calibration_from_starts
    from capplan.envvars import CAPTURE_EACH
    from capplan.files import check_output, shown, write_atomic
    from capplan.planfile.read import load_plan

    config = model / "config.json" if model.is_dir() else model
    report = output.with_name(output.name.removesuffix(".yaml").removesuffix(".yml") + ".report.json")
    sources = inputs(plan, config)
    log_out = output.with_name(output.name.removesuffix(".yaml").removesuffix(".yml") + ".log")
    for target in (output, report, log_out):  # the log is written on failure or with keep_log: checked first
        check_output(target, sources)
    if report.exists() or report.is_symlink():
        raise UsageError(f"{shown(report)}: exists; the probe keeps its report there (move it or pick another -o)")
    if name is not None and (not 0 < len(name) <= 200 or not name.isprintable()):
        raise UsageError("--name must be 1 to 200 printable characters")
    loaded = load_plan(plan)
    if loaded.tiers is not None:
        raise InputError(f"{printable(plan.name)}: a plan with tiers; a probe captures every graph at start",
                         "probe the plan without tiers (the same graphs)")  # fmt: skip
    if not loaded.graphs:
        raise InputError(f"{printable(plan.name)}: captures no graphs (cudagraph mode NONE): nothing to measure")
    shape = shape_from_config(config)
    with tempfile.TemporaryDirectory(prefix="capplan-probe-") as tmp:
        folder = model
        serve_extra: list[str] = []
        if not model.is_dir() or not any((model / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            folder = Path(tmp) / "model"  # config.json alone: the weights are dummy, no tokenizer is needed
            folder.mkdir()
            shutil.copyfile(config, folder / "config.json")
            serve_extra.append("--skip-tokenizer-init")
        command = [
            sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), "--report", str(report), "--",
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(folder), "--load-format", "dummy",
            "--port", str(_free_port()), *serve_extra, *_kv_given(serve_args), *serve_args,
        ]  # fmt: skip
        env = {**os.environ, CAPTURE_EACH: "1"}
        log_path = Path(tmp) / "serve.log"
        say(
            f"probing {len(loaded.graphs)} graphs of {printable(plan.name)} with dummy weights (vLLM's log: kept "
            + ("beside the calibration)" if keep_log else "on failure)")
        )
        t0 = time.monotonic()
        marks = StartMarks()
        with log_path.open("wb") as log, log_path.open("rb") as growing:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                seen, done, timed_out = -1, False, False
                while not done:
                    if proc.poll() is not None:
                        break
                    if time.monotonic() - t0 > limit:
                        timed_out = True
                        break
                    time.sleep(1.0)
                    marks.read(growing.read(), time.monotonic() - t0)
                    try:
                        data = json.loads(report.read_text())
                    except (OSError, ValueError):
                        continue
                    rows = data.get("captures") or []
                    done = data.get("graphs_captured") == len(loaded.graphs) and len(rows) == len(loaded.graphs)
                    if len(rows) != seen and (len(rows) - seen >= 50 or done):
                        seen = len(rows)
                        say(f"  {seen}/{len(loaded.graphs)} graphs captured, {time.monotonic() - t0:.0f} s")
            finally:
                elapsed = time.monotonic() - t0
                _stop(proc, PROBE_STOP_GRACE_S)
        kept = log_out
        if not done or keep_log:
            write_atomic(kept, log_path.read_bytes(), sources)  # never through a link; replaces an earlier log
        if not done:
            report.unlink(missing_ok=True)  # an unfinished start's report: a retry with the same -o may run
            why = f"not every graph captured in {limit:.0f} s" if timed_out else f"vLLM exited with {proc.returncode}"
            raise InputError(
                f"probe failed: {why}; vLLM's log is {shown(kept)}",
                "read the log's last lines; a start under capplan apply must succeed for a probe to",
            )
        phases = log_phases(log_path.read_text(errors="replace"), marks)
    cal = calibration_from_starts([report], [loaded], Given(shape=shape), name or output.stem)
    ident = cal.identity
    if ident is not None and ident.model is not None and ident.model.name == str(folder) and folder != model:
        said = ident.model.model_copy(update={"name": printable(str(model))[:200]})  # not the probe's temporary folder
        cal = cal.model_copy(update={"identity": ident.model_copy(update={"model": said})})
    data = cal.model_dump(mode="json", exclude_none=True)
    if cal.identity is not None:
        data["identity"] = cal.identity.model_dump(mode="json", exclude_none=True)
    start = cal.starts[0]
    header = (
        f"# Calibration probed by capplan calibrate: {printable(plan.name)} captured with dummy weights, each graph "
        f"read inside vLLM's one capture ({elapsed:.0f} s from launch to the last graph{phases}); "
        f"report: {printable(report.name)}\n"
    )
    write_atomic(output, header + _calibration_yaml(data), sources)
    return Probed(output, report, start.graphs, start.capture_seconds, start.graph_memory_gib, round(elapsed, 1))


PROBE_KV_BYTES = 4 << 30

_COMPILE = re.compile(r"torch\.compile took ([0-9.]+) s in total")
_CACHED = re.compile(r"Directly load the compiled graph")
_CAPTURED = re.compile(r"Graph capturing finished in ([0-9.]+) sec")
_LOADED = re.compile(r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds")


_VLLM_LINE = re.compile(rb"\b(?:INFO|WARNING|ERROR|DEBUG)\b[^\n]*\[[\w.]+\.py:\d+\]")
_LOADING = re.compile(rb"Loading model|Starting to load model")


class StartMarks:
    """When, in seconds from launch, vLLM's log first showed a line of its own and the engine's
    model loading began: read as the log grows (to the probe's poll, a second), since vLLM's own
    timestamps have no year or zone."""

    def __init__(self) -> None:
        self.first_line: float | None = None
        self.loading: float | None = None
        self._rest = b""

    def read(self, new: bytes, at: float) -> None:
        text = self._rest + new
        whole, _, self._rest = text.rpartition(b"\n")  # a line still being written waits for its end
        if self.first_line is None and _VLLM_LINE.search(whole):
            self.first_line = at
        if self.loading is None and _LOADING.search(whole):
            self.loading = at


def log_phases(text: str, marks: StartMarks | None = None) -> str:
    """Where a probe's time went: from launch to vLLM's first log line (the interpreter and
    vLLM's imports) and to the engine's model loading (vLLM's front end, the engine process and
    its imports), as the probe saw the log grow; then, as vLLM's log says them, model loading,
    torch.compile (from its cache or compiled cold) and graph capture. "" where the log says none
    of it (another release's wording: nothing is guessed)."""
    parts = []
    if marks is not None and marks.first_line is not None:
        parts.append(f"vLLM's first log line at {marks.first_line:.0f} s")
    if marks is not None and marks.loading is not None:
        parts.append(f"its model loading from {marks.loading:.0f} s")
    if m := _LOADED.search(text):
        parts.append(f"model loading {float(m.group(1)):.0f} s")
    compiled = [float(x) for x in _COMPILE.findall(text)]
    if compiled:
        parts.append(f"torch.compile {sum(compiled):.0f} s ({'from its cache' if _CACHED.search(text) else 'cold'})")
    if m := _CAPTURED.search(text):
        parts.append(f"capture {float(m.group(1)):.0f} s")
    return f": {', '.join(parts)}" if parts else ""


def _kv_given(serve_args: tuple[str, ...]) -> list[str]:
    """The KV cache's size given (4 GiB, unless the line gives one): vLLM then skips its profiling
    capture, so every graph's growth is what a first capture takes (what a reserve beside the KV
    cache must hold; after that pass the capture reuses memory it left allocated)."""
    if any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in serve_args):
        return []
    return ["--kv-cache-memory-bytes", str(PROBE_KV_BYTES)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PROBE_STOP_GRACE_S = 10  # the report is whole once every graph is in it: vLLM's shutdown of a server that never
# served is not waited on longer (a probe of the 8B on an H100 ended 30.6 s after its last graph)


def _stop(proc: Any, grace: float = 30) -> None:
    """The server and everything it started: SIGTERM to its process group, SIGKILL after `grace` s."""
    import os
    import signal
    import subprocess

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
