"""Batch traces and the simulator: replay real or synthetic traffic through a plan's dispatcher.

Trace format (JSON lines, one scheduled batch per line; blank lines and lines
starting with # are skipped):

    {"num_reqs": 8, "num_tokens": 8, "max_query_len": 1, "adapters": 2, "base": true, "count": 120}

- num_reqs (>= 1), num_tokens (>= num_reqs): the batch as the scheduler sends it.
- max_query_len: longest request's tokens this step; default ceil(num_tokens / num_reqs).
- adapters: distinct LoRA adapters in the batch (0..num_reqs); default 0.
- base: some requests use no adapter while others do; default false.
- has_prefill: a real prefill chunk is in the batch (0.31+ keeps it out of
  decode graphs); default false.
- count: how many steps had exactly this batch (a weight); default 1.

vLLM's own batch-size log (VLLM_LOG_BATCHSIZE_INTERVAL=1 prints "Batchsize
forward time stats (batchsize, count, median_time(ms)): [...]") converts as
well: the last such line wins (the stats are cumulative). It records token
counts after vLLM's padding and nothing about requests or adapters, so each
entry becomes a uniform decode batch of that many one-token requests without
LoRA: padding measured on it is a lower bound.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from capplan.errors import CapplanError
from capplan.planner.dispatch import Batch, Dispatcher
from capplan.schemas.plan import Plan

FIELDS = {"num_reqs", "num_tokens", "max_query_len", "adapters", "base", "has_prefill", "count"}
MAX_TRACE_LINES = 2_000_000
VLLM_LOG = re.compile(r"Batchsize forward time stats \(batchsize, count, median_time\(ms\)\): (\[.*\])")


@dataclass(frozen=True)
class TraceBatch:
    batch: Batch
    count: int


def _int(obj: dict, key: str, where: str, default: int | None = None, low: int = 0) -> int:
    value = obj.get(key, default)
    if value is None:
        raise CapplanError(f"{where}: {key} is missing", f"add \"{key}\": <integer >= {low}>")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CapplanError(f"{where}: {key} must be an integer >= {low} (got {value!r})", f"fix {key}")
    return value


def _bool(obj: dict, key: str, where: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise CapplanError(f"{where}: {key} must be true or false (got {value!r})", f"fix {key}")
    return value


def parse_batch(obj: object, where: str) -> TraceBatch:
    if not isinstance(obj, dict):
        raise CapplanError(f"{where}: a batch must be a JSON object", "write one {...} object per line")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise CapplanError(f"{where}: unknown field {unknown[0]!r}", f"known fields: {', '.join(sorted(FIELDS))}")
    reqs = _int(obj, "num_reqs", where, low=1)
    tokens = _int(obj, "num_tokens", where, low=1)
    if tokens < reqs:
        raise CapplanError(f"{where}: num_tokens {tokens} < num_reqs {reqs}", "every request schedules >= 1 token")
    max_q = _int(obj, "max_query_len", where, default=-(-tokens // reqs), low=1)
    if max_q * reqs < tokens or max_q > tokens - reqs + 1:
        raise CapplanError(f"{where}: max_query_len {max_q} is impossible for {reqs} requests and {tokens} tokens",
                           f"use a value in {-(-tokens // reqs)}..{tokens - reqs + 1}")
    adapters = _int(obj, "adapters", where, default=0)
    base = _bool(obj, "base", where)
    if adapters > reqs or (base and adapters >= reqs):
        raise CapplanError(f"{where}: {adapters} adapter(s){' + base' if base else ''} need more than {reqs} "
                           "request(s)", "each request uses at most one adapter")
    count = _int(obj, "count", where, default=1, low=1)
    return TraceBatch(Batch(reqs, tokens, max_q, adapters, base and adapters > 0, _bool(obj, "has_prefill", where)),
                      count)


def load_trace(path: Path) -> list[TraceBatch]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CapplanError(f"{path}: no such file", "give the path of a trace (JSON lines)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CapplanError(f"{path}: cannot read ({exc.__class__.__name__})", "give a UTF-8 text trace") from None
    logged = VLLM_LOG.findall(text)
    if logged:
        return _from_vllm_log(path, logged[-1])
    out: list[TraceBatch] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(out) >= MAX_TRACE_LINES:
            raise CapplanError(f"{path}: more than {MAX_TRACE_LINES} batches", "aggregate repeats with \"count\"")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CapplanError(f"{path}:{number}: not JSON ({exc.msg})", "one JSON object per line") from None
        out.append(parse_batch(obj, f"{path}:{number}"))
    if not out:
        raise CapplanError(f"{path}: the trace holds no batches", "one JSON object per line; see capplan simulate --help")
    return out


def _from_vllm_log(path: Path, stats: str) -> list[TraceBatch]:
    try:
        rows = ast.literal_eval(stats)
        out = [TraceBatch(Batch(int(bs), int(bs), 1), int(n)) for bs, n, _ in rows if int(bs) > 0 and int(n) > 0]
    except (ValueError, SyntaxError, TypeError) as exc:
        raise CapplanError(f"{path}: vLLM batch-size stats line is malformed ({exc.__class__.__name__})",
                           "pass the log as vLLM wrote it") from None
    if not out:
        raise CapplanError(f"{path}: vLLM batch-size stats list no batches", "log a longer run")
    return out


@dataclass
class SimResult:
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    real_tokens: int = 0  # tokens of batches that replayed a graph
    padded_tokens: int = 0  # tokens added by padding on those batches
    eager_tokens: int = 0
    eager_above_largest: int = 0  # eager because more tokens than the largest graph
    hits: Counter = field(default_factory=Counter)  # graph id -> steps
    by_size: dict = field(default_factory=dict)  # num_tokens -> [steps, padded tokens]
    unused: list = field(default_factory=list)  # graph ids never replayed

    @property
    def hit_rate(self) -> float:
        return self.graph_steps / self.steps if self.steps else 0.0

    @property
    def padding_overhead(self) -> float:
        """Padded tokens per real token, over batches that replayed a graph."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    def to_json(self, plan: Plan) -> dict:
        unused = Counter((plan.graphs[i].descriptor.cg_mode, plan.graphs[i].descriptor.num_active_loras)
                         for i in self.unused)
        return {
            "steps": self.steps, "graph_steps": self.graph_steps, "eager_steps": self.eager_steps,
            "graph_hit_rate": round(self.hit_rate, 6),
            "eager_above_largest_graph": self.eager_above_largest,
            "real_tokens_in_graphs": self.real_tokens, "padded_tokens": self.padded_tokens,
            "padding_overhead": round(self.padding_overhead, 6), "eager_tokens": self.eager_tokens,
            "graphs": len(plan.graphs), "graphs_used": len(plan.graphs) - len(self.unused),
            "graphs_never_used": len(self.unused),
            "never_used_by_mode_and_case": [{"cg_mode": m, "lora_case": c, "graphs": n}
                                            for (m, c), n in sorted(unused.items())],
            "by_size": [{"num_tokens": s, "steps": v[0], "padded_tokens": v[1]}
                        for s, v in sorted(self.by_size.items())],
        }


def simulate(plan: Plan, trace: list[TraceBatch], dispatcher: Dispatcher | None = None) -> SimResult:
    dispatcher = dispatcher or Dispatcher(plan)
    result = SimResult()
    largest = plan.max_capture_size
    for item in trace:
        batch, n = item.batch, item.count
        d = dispatcher.dispatch(batch)
        result.steps += n
        if d.graph_id < 0:
            result.eager_steps += n
            result.eager_tokens += n * batch.num_tokens
            result.eager_above_largest += n * (batch.num_tokens > largest)
            continue
        pad = d.num_tokens - batch.num_tokens
        result.graph_steps += n
        result.real_tokens += n * batch.num_tokens
        result.padded_tokens += n * pad
        result.hits[d.graph_id] += n
        row = result.by_size.setdefault(d.num_tokens, [0, 0])
        row[0] += n
        row[1] += n * pad
    result.unused = [i for i in range(len(plan.graphs)) if i not in result.hits]
    return result


def render_simulation(plan_name: str, trace_name: str, plan: Plan, result: SimResult) -> str:
    data = result.to_json(plan)
    lines = [
        f"capplan simulate {plan_name} {trace_name}: {data['steps']} steps",
        f"  graph hit rate {data['graph_hit_rate']:.1%} ({data['graph_steps']} steps replayed a graph, "
        f"{data['eager_steps']} eager, {data['eager_above_largest_graph']} of them above the largest graph "
        f"of {plan.max_capture_size} tokens)",
        f"  padding overhead {data['padding_overhead']:.2%} ({data['padded_tokens']} padded tokens on "
        f"{data['real_tokens_in_graphs']} real tokens in graphs)",
        f"  graphs used {data['graphs_used']} of {data['graphs']}; never used: {data['graphs_never_used']}"
        + ("" if not data["never_used_by_mode_and_case"] else " (" + ", ".join(
            f"{u['cg_mode']} case {u['lora_case']}: {u['graphs']}" for u in data["never_used_by_mode_and_case"])
            + ")"),
        "  size  steps  padded tokens",
    ]
    for row in data["by_size"]:
        lines.append(f"  {row['num_tokens']:>4}  {row['steps']:>5}  {row['padded_tokens']:>13}")
    return "\n".join(lines)
