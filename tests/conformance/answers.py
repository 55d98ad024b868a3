"""vLLM's answers to the conformance specs (an oracle script's result for one item: a spec and its
queries, or an encoder case), kept under the oracle's folder so an unchanged item is never asked
again, and asked again exactly when anything it was computed from changed.

An answer's key is the sha256 of everything it is computed from: the oracle script's source, the
release, that release's vLLM files (the path and bytes of every .py under src/<release>/vllm),
the oracle's venv (the requirements hash it was built from, its Python) and the item itself
(canonical JSON). The oracle scripts import only vLLM, torch, numpy and the standard library
(never capplan), so nothing else can change an answer. One file per answer,
ANSWERS/<release>/<key>.json = {"key", "result_sha256", "result"}, written atomically (a temporary
file in the same folder, then renamed, 0644). Every read checks the entry against its key and the
result against its hash: an entry that does not verify (corrupt, truncated, edited, another key)
is asked again and replaced, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from tests.conformance import coverage

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@cache
def release_identity(oracle_dir: Path, version: str) -> str:
    """sha256 over the path and bytes of every .py file of the release's vLLM sources."""
    top = oracle_dir / "src" / version
    digest = hashlib.sha256()
    for path in sorted((top / "vllm").rglob("*.py")):
        digest.update(path.relative_to(top).as_posix().encode() + b"\0")
        digest.update(_sha256(path.read_bytes()).encode() + b"\n")
    return digest.hexdigest()


def venv_identity(oracle_dir: Path) -> str:
    """The requirements hash the oracle's venv was built from (setup_oracle.sh's marker) and its Python."""
    venv = oracle_dir / "venv"
    return _sha256(b"".join((venv / name).read_bytes() for name in (".oracle-venv-ok", "pyvenv.cfg")))


def answer_key(script: Path, version: str, item: dict, oracle_dir: Path) -> str:
    return _sha256(
        _canonical(
            {
                "oracle": _sha256(script.read_bytes()),
                "release": version,
                "vllm": release_identity(oracle_dir, version),
                "venv": venv_identity(oracle_dir),
                "item": item,
            }
        )
    )


def read_answer(path: Path, key: str) -> dict | None:
    """The cached answer at `path` if it verifies against `key`, else None (never raises on its content)."""
    try:
        entry = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    result = entry.get("result")
    if not isinstance(result, dict) or entry.get("result_sha256") != _sha256(_canonical(result)):
        return None
    return result


def write_answer(path: Path, key: str, result: dict) -> None:
    """`result` under `key` at `path`, atomically: complete or absent, 0644, no temporary file left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _canonical({"key": key, "result_sha256": _sha256(_canonical(result)), "result": result})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run_oracle(script: Path, version: str, src: Path, out: Path, timeout: int, oracle_dir: Path = ORACLE_DIR) -> dict:
    """Run an oracle script with vLLM `version`'s sources alone on the oracle's Python (a fresh
    process: it sets vLLM's environment before importing it): its results by name."""
    env = {**os.environ, "PYTHONPATH": str(oracle_dir / "src" / version)}
    proc = subprocess.run(
        [str(oracle_dir / "venv" / "bin" / "python"), str(script), "--input", str(src), "--output", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script.name} on vLLM {version} failed:\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert data["vllm_version"] == version
    return {r["name"]: r for r in data["results"]}


def answers(
    script: Path, version: str, items: list[dict], *, list_key: str, timeout: int = 1200, oracle_dir: Path = ORACLE_DIR
) -> dict[str, dict]:
    """The oracle's result for each item (by its "name"): read where cached and verified, the
    others asked in one run of `script` ({list_key: items} in, results out) and cached."""
    folder = oracle_dir / "answers" / version
    folder.mkdir(parents=True, exist_ok=True)
    keys = {item["name"]: answer_key(script, version, item, oracle_dir) for item in items}
    found: dict[str, dict] = {}
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker asking this release: wait, then read
        for name, key in keys.items():
            result = read_answer(folder / f"{key}.json", key)
            if result is not None and result.get("name") == name:
                found[name] = result
        missing = [item for item in items if item["name"] not in found]
        if missing:
            with tempfile.TemporaryDirectory(prefix="capplan-oracle-") as tmp:
                src = Path(tmp) / "in.json"
                src.write_text(json.dumps({list_key: missing}))
                computed = run_oracle(script, version, src, Path(tmp) / "out.json", timeout, oracle_dir)
            for item in missing:
                name = item["name"]
                write_answer(folder / f"{keys[name]}.json", keys[name], computed[name])
                found[name] = computed[name]
    coverage.answered(cached=len(items) - len(missing), computed=len(missing))
    return found
