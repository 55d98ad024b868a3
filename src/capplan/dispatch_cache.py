"""Dispatch tables cached by plan content, so `capplan dispatch` skips validation it has done before.

Loading a plan validates it in full and recompiles its spec (about 0.1-0.2 s
with pydantic's import). The tables `capplan dispatch` needs are a pure
function of the plan file's bytes, so after one full load they are stored
under sha256(bytes, capplan version) in the user's cache folder
($CAPPLAN_CACHE_DIR, else $XDG_CACHE_HOME/capplan, else ~/.cache/capplan).
Any change to the file, or another capplan version, misses the cache and
loads (and refuses a bad plan) in full. CAPPLAN_NO_CACHE=1 turns it off; a
cache folder that cannot be written is silently not used. The folder keeps
the MAX_ENTRIES most recently stored plans.

`capplan compile` stores the tables of every plan it writes (`remember`):
the file is the rendering of the plan it holds in memory, so the first
`capplan dispatch` after a compile needs no load either.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from capplan import __version__
from capplan.planner.dispatch import Dispatcher

MAX_ENTRIES = 64
FIELDS = ("cg_mode", "num_tokens", "num_reqs", "uniform_token_count", "max_query_len", "num_active_loras")


def cache_dir() -> Path:
    explicit = os.environ.get("CAPPLAN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "capplan"


def tables_of(plan) -> dict:
    return {
        "vllm": plan.spec.target.vllm,
        "lora_dispatch_key": plan.lora_dispatch_key,
        "lora_dispatch_map": [[k, v] for k, v in sorted(plan.lora_dispatch_map.items())],
        "descriptors": [[getattr(d, f) for f in FIELDS] for d in plan.descriptors],
        "dispatch": [[r.lo, r.hi, r.lora_case, list(r.candidates)] for r in plan.dispatch],
    }


def _light_plan(tables: dict) -> SimpleNamespace:
    return SimpleNamespace(
        spec=SimpleNamespace(target=SimpleNamespace(vllm=tables["vllm"])),
        lora_dispatch_key=tables["lora_dispatch_key"],
        lora_dispatch_map={k: v for k, v in tables["lora_dispatch_map"]},
        descriptors=[SimpleNamespace(**dict(zip(FIELDS, d))) for d in tables["descriptors"]],
        dispatch=[SimpleNamespace(lo=lo, hi=hi, lora_case=c, candidates=cands)
                  for lo, hi, c, cands in tables["dispatch"]],
    )


def _entry(data: bytes) -> Path:
    key = hashlib.sha256(__version__.encode() + b"\0" + data).hexdigest()
    return cache_dir() / f"dispatch-{key}.json"


def _enabled() -> bool:
    return os.environ.get("CAPPLAN_NO_CACHE") != "1"


def remember(text: str, plan) -> None:
    """Store the tables of `plan`, whose rendering `text` is the plan file on disk
    byte for byte (UTF-8, `\\n` line ends) and loads back (compile checks
    `reload_problem` before writing), so dispatch on that file starts from the
    cache. Nothing is written when the entry exists. Best effort, like every
    cache write."""
    if not _enabled():
        return
    entry = _entry(text.encode("utf-8"))
    if not entry.exists():
        _store(entry, tables_of(plan))


def load_dispatcher(path: Path) -> Dispatcher:
    """A Dispatcher for the plan at `path`: from the cache when these exact bytes were loaded before."""
    if not _enabled():
        return _full(path)
    try:
        data = Path(path).read_bytes()
    except OSError:
        return _full(path)  # the full loader words the error
    entry = _entry(data)
    try:
        tables = json.loads(entry.read_text(encoding="utf-8"))
        return Dispatcher(_light_plan(tables))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    dispatcher = _full(path)
    _store(entry, tables_of(dispatcher.plan))
    return dispatcher


def _full(path: Path) -> Dispatcher:
    from capplan.loading import load_plan

    return Dispatcher(load_plan(path))


def _store(entry: Path, tables: dict) -> None:
    # A temp name of our own and an atomic rename (tempfile's import alone
    # costs more than this whole write on the first-query path).
    tmp = entry.with_name(f".{entry.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x", encoding="utf-8") as handle:
            json.dump(tables, handle, separators=(",", ":"))
        os.replace(tmp, entry)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return
    _evict(entry.parent)


def _evict(folder: Path) -> None:
    """Keep the MAX_ENTRIES most recently written tables (every edit of a plan adds
    one), and drop temp files an interrupted write left behind an hour ago."""
    now = time.time()
    entries = []
    try:
        names = list(folder.iterdir())
    except OSError:
        return
    for path in names:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue  # another process removed it
        if path.name.startswith("dispatch-") and path.suffix == ".json":
            entries.append((mtime, path))
        elif path.name.startswith(".dispatch-") and path.suffix == ".tmp" and now - mtime > 3600:
            _unlink(path)
    entries.sort(reverse=True)
    for _, path in entries[MAX_ENTRIES:]:
        _unlink(path)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
