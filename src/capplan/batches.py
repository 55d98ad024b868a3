"""Batch files: one JSON-lines format for `dispatch --queries`, `simulate` and `optimize`.

One scheduled batch per line (blank lines and lines starting with # are skipped):

    {"num_reqs": 8, "num_tokens": 8, "max_query_len": 1, "num_active_loras": 2, "base": true, "count": 120}

- num_reqs (>= 1) and num_tokens (>= num_reqs): required;
- max_query_len: the longest request's tokens; default ceil(num_tokens / num_reqs);
- num_active_loras: distinct LoRA adapters in the batch; default 0. `adapters`
  is accepted as the older name (not both on one line);
- base: some requests use no adapter while others do; default false;
- has_prefill: a real prefill chunk is in the batch (vLLM 0.28+ keeps it out
  of decode graphs); default false;
- uniform_token_count: override the uniform-decode count vLLM would derive;
- count: how many steps had exactly this batch (a weight); default 1;
- t: seconds since recording started (written by capplan's trace recorder,
  `capplan apply --trace`; a finite number >= 0; calibrate-trace reads the
  intervals, the other readers ignore it);
- dp_step: under data parallelism, the DP step (counted alike on every rank,
  idle steps included) the batch ran in; the recorder writes it, and
  `simulate` aligns rank traces by it. A line with dp_step has count 1.

A vLLM log written with VLLM_LOG_BATCHSIZE_INTERVAL is read too ("Batchsize
forward time stats" lines; the last wins, the stats are cumulative). The
format is decided by the whole file: JSON lines only, or a log with stats
lines and no JSON batch lines; a file that mixes them is refused, naming a
line of each.

Against a plan, every batch must be one the deployment can schedule (at most
max_num_seqs requests, max_num_batched_tokens tokens, max_loras adapters):
a trace from another deployment is refused, not silently answered.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

from capplan.errors import InputError, UsageError, printable
from capplan.files import json_value, shown, text_lines
from capplan.limits import MAX_TRACE_BYTES
from capplan.planner.dispatch import Batch, beyond_spec
from capplan.schemas.spec import Spec
from capplan.traffic.simulate import TraceBatch

FIELDS = (
    "num_reqs",
    "num_tokens",
    "max_query_len",
    "num_active_loras",
    "base",
    "has_prefill",
    "uniform_token_count",
    "count",
    "dp_step",
)
ALIASES = {"adapters": "num_active_loras"}
IGNORED = ("t",)  # the recorder's timestamp
MAX_BATCHES = 2_000_000
VLLM_LOG = re.compile(r"Batchsize forward time stats \(batchsize, count, median_time\(ms\)\): (\[.*\])")
LOG_NOTE = (
    "a vLLM batch-size log lists padded token counts only for steps that ran through "
    "set_forward_context: no requests, no adapters, and on MRV2 no FULL graph replays; "
    "results from it are partial (record a trace with capplan's runtime instead)"
)


class BatchFileError(InputError):
    """A batch file (trace or queries) is unreadable or holds an impossible batch."""


@dataclass
class BatchFile:
    batches: list[TraceBatch]
    source: str  # "jsonl" or "vllm-log"
    times: list[float] | None = None  # `t` of every line (a trace capplan recorded), else None
    stopped: bool = False  # the recorder stopped at its size limit: the trace is the run's beginning
    cut: str | None = None  # what read_rank_traces cut or joined, and why
    dropped: str | None = None  # the batches the deployment never schedules, left out on request

    @property
    def note(self) -> str | None:
        notes = [n for n in (LOG_NOTE if self.source == "vllm-log" else None, self.cut, self.dropped) if n]
        return "; ".join(notes) or None


def batch_problem(batch: Batch) -> str | None:
    """Why no scheduler makes this batch, or None."""
    r, t, q = batch.num_reqs, batch.num_tokens, batch.max_query_len
    if r < 1:
        return f"num_reqs must be >= 1 (got {r})"
    if t < r:
        return f"num_tokens ({t}) must be >= num_reqs ({r}): every request schedules a token"
    lo, hi = -(-t // r), t - (r - 1)
    if not lo <= q <= hi:
        return f"max_query_len must be in {lo}..{hi} for {r} requests and {t} tokens (got {q})"
    if batch.num_active_loras < 0:
        return f"num_active_loras must be >= 0 (got {batch.num_active_loras})"
    if batch.num_active_loras > r:
        return f"num_active_loras ({batch.num_active_loras}) exceeds num_reqs ({r})"
    if batch.base and batch.num_active_loras >= r:
        return "base needs a request without an adapter, but every request has one"
    u = batch.uniform_token_count
    if u is not None:
        if u < 1:
            return f"uniform_token_count must be >= 1 (got {u})"
        if u * r != t or q != u:
            return (
                f"uniform_token_count {u} means every one of the {r} requests schedules {u} tokens "
                f"({u * r} tokens, max_query_len {u}), but the batch has {t} tokens and max_query_len {q}; "
                "leave it out and it is derived as vLLM derives it"
            )
    return None


def batch_from_args(
    reqs: int,
    tokens: int,
    max_query_len: int | None,
    loras: int,
    base: bool,
    has_prefill: bool,
    uniform: int | None,
    spec: Spec,
) -> Batch:
    """The batch `capplan dispatch --reqs ... --tokens ...` asks about (UsageError when impossible)."""
    if reqs < 1:
        raise UsageError(f"--reqs must be >= 1 (got {reqs})")
    if max_query_len is None:
        max_query_len = -(-tokens // reqs) if tokens >= reqs else tokens
    batch = Batch(reqs, tokens, max_query_len, loras, base, has_prefill, uniform)
    problem = batch_problem(batch) or beyond_spec(batch, spec)
    if problem:
        for field, option in (
            ("num_reqs", "--reqs"),
            ("num_tokens", "--tokens"),
            ("max_query_len", "--max-query-len"),
            ("num_active_loras", "--loras"),
            ("uniform_token_count", "--uniform"),
            ("has_prefill", "--has-prefill"),
        ):
            problem = problem.replace(field, option)
        raise UsageError(problem)
    return batch


def _int(item: dict, key: str, default: int, low: int) -> int:
    value = item.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: must be an integer (got {printable(repr(value))[:40]})")
    if value < low:
        raise ValueError(f"{key}: must be >= {low} (got {value})")
    return value


def check_stamp(stamp: object) -> None:
    """The recorder's `t`: seconds, a finite number >= 0 (ValueError naming the field)."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not 0 <= stamp < 1e12:
        raise ValueError(f"t: must be a finite number of seconds >= 0 (got {printable(repr(stamp))[:40]})")


def parse_batch(item: object) -> TraceBatch:
    """One JSON object -> a batch (ValueError naming the field)."""
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    for old, new in ALIASES.items():
        if old in item:
            if new in item:
                raise ValueError(f"{old} and {new} name the same field; give one")
            item = {(new if k == old else k): v for k, v in item.items()}
    unknown = sorted(set(item) - set(FIELDS) - set(IGNORED))
    if unknown:
        raise ValueError(f"unknown key {printable(unknown[0])[:40]!r}; known: {', '.join(FIELDS)} (or adapters)")
    for key in ("num_reqs", "num_tokens"):
        if key not in item:
            raise ValueError(f"{key}: is required")
    reqs = _int(item, "num_reqs", 1, 1)
    tokens = _int(item, "num_tokens", 1, 1)
    max_q = _int(item, "max_query_len", -(-tokens // reqs), 1)
    loras = _int(item, "num_active_loras", 0, 0)
    uniform = _int(item, "uniform_token_count", 1, 1) if "uniform_token_count" in item else None
    count = _int(item, "count", 1, 1)
    dp_step = _int(item, "dp_step", 0, 0) if "dp_step" in item else None
    if dp_step is not None and dp_step > 2**53:
        raise ValueError(f"dp_step: must be at most {2**53} (got {dp_step})")
    if dp_step is not None and count != 1:
        raise ValueError("dp_step: a line with dp_step is one step (count must be 1)")
    if "t" in item:
        check_stamp(item["t"])
    flags = {}
    for key in ("base", "has_prefill"):
        value = item.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false (got {printable(repr(value))[:40]})")
        flags[key] = value
    batch = Batch(reqs, tokens, max_q, loras, flags["base"], flags["has_prefill"], uniform)
    problem = batch_problem(batch)
    if problem:
        raise ValueError(problem)
    return TraceBatch(batch, count, dp_step)


def read_rank_traces(paths: list[Path], spec: Spec, drop_unschedulable: bool = False) -> list[BatchFile]:
    """One trace, or one per DP rank (as many as the spec's data_parallel_size; `capplan apply
    --trace` records one per rank); with `drop_unschedulable`, batches the deployment never
    schedules are left out, not refused. The ranks of a dense model are independent engines
    (no DP padding): their traces come back as one, every batch dispatched on its own."""
    size, ranks = spec.parallel.synced_size, spec.parallel.data_parallel_size
    if len(paths) > 1 and len(paths) != ranks:
        raise UsageError(
            f"{len(paths)} traces for a plan of data_parallel_size {ranks}",
            "give one trace, or one per DP rank" if ranks > 1 else "give one trace",
        )
    files = [read_batches(p, spec, allow_empty=len(paths) > 1, drop_unschedulable=drop_unschedulable) for p in paths]
    if len(files) > 1 and not any(f.batches for f in files):
        raise UsageError("every rank trace is empty", "pass the traces of a run that served requests")
    if len(files) > 1:
        _distinct(paths)
    if len(files) > 1 and size == 1:
        notes = {f.note for f in files if f.note}
        joined = f"the {len(files)} DP ranks of a dense model run as independent engines: their traces replayed as one"
        return [
            BatchFile(
                [b if b.dp_step is None else TraceBatch(b.batch, b.count, None) for f in files for b in f.batches],
                "vllm-log" if any(f.source == "vllm-log" for f in files) else "jsonl",
                stopped=any(f.stopped for f in files),
                cut="; ".join([joined, *sorted(n for n in notes if n != LOG_NOTE)]),
            )
        ]
    if len(files) > 1:
        for p, f in zip(paths, files):
            if f.source != "jsonl":
                raise UsageError(f"{shown(p)}: a vLLM batch-size log has no step order; DP needs recorded traces")
        with_steps = [f for f in files if any(b.dp_step is not None for b in f.batches)]
        busy = [f for f in files if f.batches]  # an empty rank trace goes with either kind
        if with_steps and (len(with_steps) != len(busy) or any(b.dp_step is None for f in files for b in f.batches)):
            raise UsageError("some rank traces carry dp_step and some do not", "pass traces of one recording")
        for p, f in zip(paths, files):
            steps = [b.dp_step for b in f.batches if b.dp_step is not None]
            if len(set(steps)) != len(steps):
                raise UsageError(f"{shown(p)}: a dp_step appears twice", "pass one rank's trace per file")
        stopped = [f for f in files if f.stopped]
        if stopped:
            _cut_to_shortest(paths, files, stopped)
            if not any(f.batches for f in files):
                raise UsageError(
                    "no rank has a step before the first trace stopped at the recorder's size limit",
                    "raise CAPPLAN_TRACE_MAX_MB and record again",
                )
    return files


def _distinct(paths: list[Path]) -> None:
    """Refuse one file given for two ranks."""
    for i, p in enumerate(paths):
        for q in paths[:i]:
            if os.path.samefile(p, q):
                raise UsageError(f"{shown(p)} is given for two ranks", "pass each rank's own trace")


def _cut_to_shortest(paths: list[Path], files: list[BatchFile], stopped: list[BatchFile]) -> None:
    """A rank whose recorder stopped at its size limit recorded only the run's beginning: the
    other ranks are cut where it stopped, so no rank is replayed as idle where it was not."""
    with_steps = all(b.dp_step is not None for f in files for b in f.batches)
    if with_steps:
        limit = min(max((b.dp_step or 0) for b in f.batches) if f.batches else -1 for f in stopped)
        for f in files:
            f.batches = [b for b in f.batches if (b.dp_step or 0) <= limit]
        what = f"dp_step {limit}"
    else:
        limit = min(sum(b.count for b in f.batches) for f in stopped)
        for f in files:
            kept, seen = [], 0
            for b in f.batches:
                if seen >= limit:
                    break
                take = min(b.count, limit - seen)
                kept.append(b if take == b.count else TraceBatch(b.batch, take, b.dp_step))
                seen += take
            f.batches = kept
        what = f"step {limit}"
    names = ", ".join(shown(p) for p, f in zip(paths, files) if f.stopped)
    for f in files:
        f.cut = f"{names} stopped at the recorder's size limit: every rank is replayed up to {what} only"


STOP_MARK = b"# capplan: trace stopped"  # what the recorder writes when it stops at its limit


def _stopped(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - 4096))
            return STOP_MARK in handle.read()
    except OSError:
        return False


# The recorder's `t`, as it writes it (last, ", " and ": " as json.dumps puts them): a plain
# decimal below 1e12, which check_stamp accepts.
_RECORDED_T = re.compile(r'(\{.*), "t": ((?:0|[1-9][0-9]{0,11})(?:\.[0-9]{1,12})?)\}')


_LAYOUT = re.compile(r"; (tensor_parallel_size|pipeline_parallel_size) ([1-9][0-9]{0,3})(?=;|$)")


def trace_layout(path: Path) -> dict[str, int]:
    """The parallel sizes the recorder wrote into a trace's header line (`# capplan trace:
    ...; tensor_parallel_size 8; pipeline_parallel_size 1`); empty when the trace has none
    (written by hand, or by a recorder before it noted them)."""
    from capplan.files import file_head

    try:
        head = file_head(str(path), 4096) or b""
    except OSError:
        return {}
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    if not first.startswith("# capplan trace:"):
        return {}
    return {name: int(size) for name, size in _LAYOUT.findall(first)}


def read_batches(
    path: Path, spec: Spec | None = None, allow_empty: bool = False, drop_unschedulable: bool = False
) -> BatchFile:
    """Every batch of a JSON-lines file or vLLM log, all checked before any is used
    (`allow_empty`: a DP rank's trace may hold none: the rank served nothing;
    `drop_unschedulable`: a batch the spec's deployment never schedules is left out and
    counted, not refused: a trace recorded on another deployment, fitted to this one)."""
    name = shown(path)
    json_lines: list[tuple[int, str]] = []
    stats: list[tuple[int, str]] = []
    other: tuple[int, str] | None = None
    times: list[float] | None = []  # the recorder's step times, when every line has one
    for number, line in text_lines(path, "batch file", BatchFileError, MAX_TRACE_BYTES):
        text = line.strip()  # text_lines gives no blank or comment line
        if text.startswith("{"):
            json_lines.append((number, text))
            if len(json_lines) > MAX_BATCHES:
                raise BatchFileError(f"{name}: more than {MAX_BATCHES} batch lines", 'merge repeats with "count"')
            continue
        logged = VLLM_LOG.search(text)
        if logged:
            stats.append((number, logged.group(1)))
        elif other is None:
            other = (number, text)
    if json_lines and stats:
        raise BatchFileError(
            f"{name}: mixes JSON batch lines (line {json_lines[0][0]}) and vLLM batch-size stats (line {stats[0][0]})",
            "give one kind of trace per file",
        )
    if stats:
        batches = _from_vllm_log(name, *stats[-1], spec)
        source = "vllm-log"
    else:
        if other is not None:
            raise BatchFileError(
                f"{name}:{other[0]}: not a JSON batch line (and the file is no vLLM batch-size log)",
                "one JSON object per line; see capplan simulate --help",
            )
        batches = []
        seen: dict[tuple, TraceBatch] = {}  # a trace repeats its batches: each distinct line is checked once
        # A line read before, or one that differs from it only in the recorder's `t` (written
        # last, as the recorder writes it), is the batch it was: 1M recorded steps are a few
        # thousand distinct lines, each parsed and checked once.
        lines_read: dict[tuple[str, bool], tuple[TraceBatch, float | None]] = {}
        progress = _Progress(name, len(json_lines))
        try:
            for done, (number, text) in enumerate(json_lines):
                if done % 100_000 == 0:
                    progress.show(done)
                stamped = _RECORDED_T.fullmatch(text)
                line_key = (stamped.group(1), True) if stamped else (text, False)
                known = lines_read.get(line_key)
                if known is not None:
                    batches.append(known[0])
                    stamp_value = float(stamped.group(2)) if stamped else known[1]
                    if stamp_value is None:
                        times = None
                    elif times is not None:
                        times.append(stamp_value)
                    continue
                try:
                    item = json_value(text)
                    key = None
                    if isinstance(item, dict) and all(type(v) in (int, str, bool, float) for v in item.values()):
                        key = tuple((k, type(v), v) for k, v in item.items() if k != "t")
                    parsed = seen.get(key) if key is not None else None
                    if parsed is None:
                        parsed = parse_batch(item)
                        if key is not None and len(seen) < 100_000:
                            seen[key] = parsed
                    elif isinstance(item, dict) and "t" in item:
                        check_stamp(item["t"])  # the timestamp differs line by line
                    batches.append(parsed)
                    stamp = item.get("t") if isinstance(item, dict) else None
                    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
                        if times is not None:
                            times.append(float(stamp))
                        if len(lines_read) < 100_000:
                            lines_read[line_key] = (parsed, float(stamp))
                    else:
                        times = None
                        if len(lines_read) < 100_000:
                            lines_read[line_key] = (parsed, None)
                except ValueError as exc:  # json.JSONDecodeError is a ValueError
                    hint = None
                    if number == json_lines[-1][0] and type(exc).__name__ == "JSONDecodeError":
                        hint = "the last line is cut short, as a recorder stopped mid-write leaves it: delete that line"
                    raise BatchFileError(f"{name}:{number}: {printable(str(exc))[:200]}", hint) from None
        finally:
            progress.close()
        source = "jsonl"
    if not batches and not allow_empty:
        raise BatchFileError(f"{name}: holds no batches", "one JSON object per line; see capplan simulate --help")
    dropped = None
    if spec is not None and drop_unschedulable:
        batches, dropped = _drop_unschedulable(batches, spec)
        if not batches and not allow_empty:
            raise BatchFileError(f"{name}: holds no batch this deployment schedules: {dropped}")
        dropped = dropped and f"{name}: {dropped}"
    elif spec is not None:
        checked: set[int] = set()
        for number, item in _numbered(json_lines, batches, source):
            if id(item) in checked:
                continue
            checked.add(id(item))
            problem = beyond_spec(item.batch, spec)
            if problem:
                raise BatchFileError(
                    f"{name}:{number}: {problem}: this deployment never schedules it",
                    "record the trace on the deployment the plan is for, or leave such batches out with "
                    "--drop-unschedulable (simulate, optimize)",
                )
    if dropped is not None:
        times = None  # the kept steps' intervals are not the run's
    return BatchFile(batches, source, times if source == "jsonl" and times else None, _stopped(path), None, dropped)


def _drop_unschedulable(batches: list[TraceBatch], spec: Spec) -> tuple[list[TraceBatch], str | None]:
    """The batches the deployment schedules, and what was left out: steps by reason."""
    problems: dict[Batch, str | None] = {}
    kept: list[TraceBatch] = []
    reasons: dict[str, int] = {}
    lines = steps = total = 0
    for item in batches:
        total += item.count
        if item.batch not in problems:
            problems[item.batch] = beyond_spec(item.batch, spec)
        problem = problems[item.batch]
        if problem is None:
            kept.append(item)
            continue
        lines += 1
        steps += item.count
        if "more than " in problem:
            why = "more than " + problem.split("more than ", 1)[1]
        else:
            why = "adapters while LoRA is off" if "LoRA is off" in problem else problem
        reasons[why] = reasons.get(why, 0) + item.count
    if not lines:
        return kept, None
    shown_reasons = ", ".join(f"{n} with {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return kept, f"dropped {steps} of {total} steps ({lines} line(s)) this deployment never schedules: {shown_reasons}"


class _Progress:
    """`reading NAME: 40% of 1000000 lines` on a terminal's stderr, once reading has taken 2 s;
    nothing when stderr is not a terminal (logs and pipes get the result line only)."""

    def __init__(self, name: str, total: int) -> None:
        import sys
        import time

        self.name, self.total, self.start = name, total, time.perf_counter()
        self.stream = sys.stderr
        self.shown = False
        self.tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False

    def show(self, done: int) -> None:
        import time

        if self.tty and time.perf_counter() - self.start > 2.0:
            self.stream.write(f"\rcapplan: reading {self.name}: {done / self.total:.0%} of {self.total} lines")
            self.stream.flush()
            self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _numbered(json_lines, batches, source):
    if source == "jsonl":
        return [(number, batch) for (number, _), batch in zip(json_lines, batches)]
    return [("stats", batch) for batch in batches]


def _from_vllm_log(name: str, number: int, stats: str, spec: Spec | None) -> list[TraceBatch]:
    """vLLM's [(batchsize, count, median_ms), ...] -> batches of one-token requests (at most
    max_num_seqs of them; a larger batch becomes max_num_seqs requests of even length)."""
    where = f"{name}:{number}"
    if len(stats) > 1_000_000:
        raise BatchFileError(f"{where}: the stats line is too long to be vLLM's")
    try:
        rows = ast.literal_eval(stats)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise BatchFileError(f"{where}: vLLM batch-size stats are malformed", "pass the log as vLLM wrote it") from None
    if not isinstance(rows, list):
        raise BatchFileError(f"{where}: vLLM batch-size stats must be a list")
    seqs = spec.scheduler.max_num_seqs if spec is not None else None
    out = []
    for row in rows:
        if not (
            isinstance(row, tuple)
            and len(row) == 3
            and all(type(v) is int for v in row[:2])
            and isinstance(row[2], (int, float))
            and not isinstance(row[2], bool)
        ):
            raise BatchFileError(
                f"{where}: vLLM batch-size stats entry {printable(repr(row))[:60]} is not "
                "(integer batch size, integer count, time)",
                "pass the log as vLLM wrote it",
            )
        tokens, count = row[0], row[1]
        if tokens < 1 or count < 1 or tokens > 1 << 30 or count > 1 << 40:
            raise BatchFileError(f"{where}: vLLM batch-size stats entry {row!r} is out of range")
        reqs = tokens if seqs is None else min(tokens, seqs)
        out.append(TraceBatch(Batch(reqs, tokens, -(-tokens // reqs)), count))
    return out
