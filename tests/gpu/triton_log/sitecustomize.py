"""Log every Triton kernel compile (or cache load) of a GPU run: which kernel, how long, and
during which capplan capture, if any. For diagnosing first-of-shape stalls, never for a result.

Put this directory first on PYTHONPATH and set CAPPLAN_TRITON_LOG to a directory: every
process then appends JSON lines to `<dir>/triton-<pid>.jsonl`. Off (nothing imported) when
CAPPLAN_TRITON_LOG is unset. It shadows any other sitecustomize; the GPU image has none that
vLLM needs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

_DIR = os.environ.get("CAPPLAN_TRITON_LOG")


def _context() -> dict:
    """The capplan capture this compile runs in (its graph), else the innermost vLLM frames."""
    frame = sys._getframe(2)
    names = []
    while frame is not None:
        code = frame.f_code
        me = frame.f_locals.get("self")
        # deferred capture's one graph: capplan.runtime.deferred.vllm_capture.VllmCapture.__call__
        if code.co_name == "__call__" and type(me).__name__ == "VllmCapture" and "gid" in frame.f_locals:
            try:
                from capplan.schemas.plan import address

                graph = address(me.ctx.plan.graphs[frame.f_locals["gid"]].descriptor)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: say what went wrong
                graph = f"? ({exc})"
            return {"capture": graph}
        if "vllm" in code.co_filename and len(names) < 4:
            names.append(code.co_name)
        frame = frame.f_back
    return {"capture": None, "frames": names}


_failed: list[str] = []


def _append(line: str) -> None:
    """One line onto this process's log: created 0644 under the umask, never through a symlink;
    a failure is said once and the run goes on."""
    path = os.path.join(_DIR, f"triton-{os.getpid()}.jsonl")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(line)
    except OSError as exc:
        if not _failed:
            _failed.append(path)
            print(f"triton_log: {path}: not written ({exc.strerror or exc})", file=sys.stderr)


def _wrap(compile_fn):
    if getattr(compile_fn, "_capplan_logged", False):
        return compile_fn

    @functools.wraps(compile_fn)
    def logged(src, *args, **kwargs):
        started = time.perf_counter()
        try:
            return compile_fn(src, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            fn = getattr(src, "fn", None)
            row = {
                "t": round(time.time(), 3),
                "seconds": round(seconds, 4),
                "kernel": getattr(fn, "__name__", None) or getattr(src, "name", None) or type(src).__name__,
                "attrs": str(getattr(src, "attrs", ""))[:300],
                "constants": str(getattr(src, "constants", ""))[:300],
                **_context(),
            }
            _append(json.dumps(row) + "\n")

    logged._capplan_logged = True  # type: ignore[attr-defined]
    return logged


def _install() -> None:
    # Triton's JIT reads `triton.compiler.compile` as it binds a kernel (`create_binder`),
    # and inductor calls `triton.compile`: both names, and the defining module's, are wrapped.
    import triton
    import triton.compiler
    import triton.compiler.compiler as compiler

    for module in (compiler, triton.compiler, triton):
        module.compile = _wrap(module.compile)


if _DIR:
    try:
        os.makedirs(_DIR, exist_ok=True)
        _install()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the run
        print(f"triton_log: not installed ({type(exc).__name__}: {exc})", file=sys.stderr)
