"""Record every step the engine runs as a batch trace (`capplan apply --trace`, CAPPLAN_TRACE).

One JSON line per model-runner step, in the batch format `simulate`,
`optimize` and `dispatch --queries` read (capplan.batches):

    {"num_reqs": 64, "num_tokens": 64, "max_query_len": 1, "num_active_loras": 3, "base": true, "t": 12.5031}

Under data parallelism each line also carries `dp_step`: how many model-runner
steps passed through vLLM's DP sync before this one, counted alike on every
rank (idle dummy steps included), so `simulate` lines the ranks' traces up.

`t` is seconds since the recorder started (the readers ignore it; it dates a
step and gives the interval between busy steps). Lines are buffered and
written at most once a second by a background thread, so the step path only
appends to a list. The file is bounded: at the limit (CAPPLAN_TRACE_MAX_MB,
default 256, the size `simulate` reads) recording stops and says so on stderr
and in the file. One worker of each DP rank writes (TP rank 0 of the first
pipeline stage: the others run the same steps). With data parallelism each
DP rank writes its own file: `{rank}` in the path is replaced by the DP rank,
or `.rankN` is added before the suffix when the path has no `{rank}`. Dummy runs (profiling, warm-up,
capture, DP idle steps) and vLLM's start-up warm-up steps are not recorded.

Recording reads the batch after vLLM ran it and never changes what runs.
The time spent recording is measured per step and written to the run's report.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from capplan.files import open_stream
from capplan.runtime.log import log

ENV = "CAPPLAN_TRACE"
ENV_MAX_MB = "CAPPLAN_TRACE_MAX_MB"
DEFAULT_MAX_MB = 256
LAYOUT_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size")  # read back by capplan.batches.trace_layout
WARMUP_PREFIXES = ("_warmup_", "_v2_mixed_warmup")  # request ids of vLLM's start-up warm-up steps


def _is_trace(path: str) -> bool:
    from capplan.files import file_head

    try:
        return file_head(path, 16) == b"# capplan trace:"
    except OSError:
        return False


def trace_path(template: str, rank: int, dp_size: int) -> str:
    """The file one rank writes ({pid} is the writing process's id)."""
    template = template.replace("{pid}", str(os.getpid()))
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    if dp_size <= 1:
        return template
    path = Path(template)
    return str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


class Recorder:
    def __init__(self, path: str, max_bytes: int, header: str) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.t0 = time.perf_counter()
        self.steps = 0
        self.seconds = 0.0  # time spent in step(), for the report
        self.written = 0
        self.stopped: str | None = None
        self._pending: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._file = open_stream(path, _is_trace, "a capplan trace")  # replaces only an earlier trace
        self._write(f"# {header}\n")
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="capplan-trace", daemon=True)
        self._thread.start()

    def step(
        self,
        num_reqs: int,
        num_tokens: int,
        max_query_len: int,
        adapters: int,
        base: bool,
        has_prefill: bool,
        started: float | None = None,
        dp_step: int | None = None,
    ) -> None:
        """Queue one step (formatted by the writer thread, not here). `started`: when the
        caller began its own recording work, so the overhead counted includes it."""
        now = time.perf_counter()
        with self._lock:
            self._pending.append(
                (num_reqs, num_tokens, max_query_len, adapters, base, has_prefill, now - self.t0, dp_step)
            )
        self.steps += 1
        self.seconds += time.perf_counter() - (now if started is None else started)

    @staticmethod
    def _line(step: tuple[Any, ...]) -> str:
        num_reqs, num_tokens, max_query_len, adapters, base, has_prefill, t, dp_step = step
        line: dict[str, Any] = {"num_reqs": num_reqs, "num_tokens": num_tokens, "max_query_len": max_query_len}
        if adapters:
            line["num_active_loras"] = adapters
            if base:
                line["base"] = True
        if has_prefill:
            line["has_prefill"] = True
        line["t"] = round(t, 4)
        if dp_step is not None:
            line["dp_step"] = dp_step
        return json.dumps(line, separators=(", ", ": "))

    def _loop(self) -> None:
        while not self._closed:
            time.sleep(1.0)
            self.flush()

    def _write(self, text: str) -> None:
        self._file.write(text)
        self.written += len(text.encode())

    def flush(self) -> None:
        with self._lock:
            steps, self._pending = self._pending, []
        if not steps or self.stopped:
            return
        try:
            for step in steps:
                line = self._line(step)
                if self.written + len(line) + 1 > self.max_bytes:
                    self.stopped = (
                        f"stopped at the {self.max_bytes // 2**20} MiB limit ({ENV_MAX_MB}) after {self.steps} steps"
                    )
                    self._write(f"# capplan: trace {self.stopped}\n")
                    log.warning("trace %s %s", self.path, self.stopped)
                    break
                self._write(line + "\n")
            self._file.flush()
        except OSError as exc:  # a trace must never break the engine
            self.stopped = f"stopped: cannot write ({exc.strerror})"
            log.warning("trace %s %s", self.path, self.stopped)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        try:
            self._file.close()
        except OSError:
            pass

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "steps": self.steps,
            "bytes": self.written,
            "overhead_us_per_step": round(1e6 * self.seconds / self.steps, 2) if self.steps else None,
            "stopped": self.stopped,
        }


def max_trace_mb(value: str | None) -> float:
    """CAPPLAN_TRACE_MAX_MB as a size: a finite positive number of MiB (up to 1 TiB); anything
    else is the default, said on stderr (a trace setting must never stop the engine)."""
    if value is None or value == "":
        return DEFAULT_MAX_MB
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 1 <= number <= 2**20:  # NaN fails every comparison
        log.warning("%s=%r is not a size in MiB (1 <= MB <= 1048576); using %d", ENV_MAX_MB, value[:40], DEFAULT_MAX_MB)
        return DEFAULT_MAX_MB
    return number


def layout_note(parallel_config: object) -> str:
    """The engine's parallel sizes, for the trace's header (capplan calibrate-trace records
    them in the calibration it fits: step times depend on them)."""
    sizes = [(name, getattr(parallel_config, name, None)) for name in LAYOUT_FIELDS]
    return "".join(f"; {name} {size}" for name, size in sizes if type(size) is int)


def open_recorder(rank: int, dp_size: int, header: str) -> Recorder | None:
    """The recorder CAPPLAN_TRACE asks for, or None."""
    template = os.environ.get(ENV)
    if not template:
        return None
    max_mb = max_trace_mb(os.environ.get(ENV_MAX_MB))
    path = trace_path(template, rank, dp_size)
    try:
        return Recorder(path, int(max_mb * 2**20), header)
    except OSError as exc:
        raise SystemExit(f"capplan: {ENV}={template}: cannot write {path} ({exc.strerror})") from None
