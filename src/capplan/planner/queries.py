"""Batches from the command line or a JSON-lines file, checked for shapes no scheduler makes."""

from __future__ import annotations

import json
from pathlib import Path

from capplan.errors import SpecError, UsageError
from capplan.planner.dispatch import Batch

MAX_QUERY_FILE_BYTES = 256 * 1024 * 1024
_FIELDS = {
    "num_reqs", "num_tokens", "max_query_len", "num_active_loras",
    "base", "has_prefill", "uniform_token_count",
}
_REQUIRED = ("num_reqs", "num_tokens", "max_query_len", "num_active_loras")


def check_batch(batch: Batch) -> str | None:
    """Why this batch cannot exist, or None."""
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
    if batch.uniform_token_count is not None and batch.uniform_token_count < 1:
        return f"uniform_token_count must be >= 1 (got {batch.uniform_token_count})"
    return None


def batch_from_args(
    reqs: int, tokens: int, max_query_len: int | None, loras: int, base: bool,
    has_prefill: bool, uniform: int | None,
) -> Batch:
    if reqs < 1:
        raise UsageError(f"--reqs must be >= 1 (got {reqs})")
    if max_query_len is None:
        max_query_len = -(-tokens // reqs) if tokens >= reqs else tokens
    batch = Batch(reqs, tokens, max_query_len, loras, base, has_prefill, uniform)
    problem = check_batch(batch)
    if problem:
        raise UsageError(problem.replace("num_reqs", "--reqs").replace("num_tokens", "--tokens")
                         .replace("max_query_len", "--max-query-len")
                         .replace("num_active_loras", "--loras"))
    return batch


def read_queries(path: Path) -> list[Batch]:
    """Parse and check every line before answering any, so output is all or nothing."""
    try:
        if path.stat().st_size > MAX_QUERY_FILE_BYTES:
            raise SpecError(f"{path}: larger than {MAX_QUERY_FILE_BYTES} bytes")
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not UTF-8 text") from None
    batches = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise SpecError(f"{where}: each line must be a JSON object")
        unknown = sorted(set(item) - _FIELDS)
        if unknown:
            raise SpecError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_FIELDS))}")
        for key in _REQUIRED:
            if key not in item:
                raise SpecError(f"{where}: {key}: is required")
        for key in (*_REQUIRED, "uniform_token_count"):
            value = item.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise SpecError(f"{where}: {key}: must be an integer (got {value!r})")
        for key in ("base", "has_prefill"):
            if not isinstance(item.get(key, False), bool):
                raise SpecError(f"{where}: {key}: must be true or false (got {item[key]!r})")
        batch = Batch(
            item["num_reqs"], item["num_tokens"], item["max_query_len"], item["num_active_loras"],
            item.get("base", False), item.get("has_prefill", False), item.get("uniform_token_count"),
        )
        problem = check_batch(batch)
        if problem:
            raise SpecError(f"{where}: {problem}")
        batches.append(batch)
    return batches
