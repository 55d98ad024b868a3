"""A fork server for the checks run on the oracle's Python: one process imports a release's vLLM
once, then forks a fresh copy of itself for every check script, instead of every script paying
vLLM's import (tens of seconds on two cores) again.

    PYTHONPATH=SRC/<release>:REPO/src:REPO python forkserver.py SOCKET WATCH_PID MODULE...

Imports each MODULE (in that order: a prefix of what the scripts import first, so a script meets
vLLM as a fresh process would), listens on the Unix socket SOCKET, prints "ready" and serves
until the process WATCH_PID (the test run: pytest, or xdist's controller) has gone, then removes
SOCKET's folder. Standard library only; the client is oracle_python.py.

A request is one JSON line: {"argv": [SCRIPT, ARG...] or ["-c", CODE, ARG...], "env": {...},
"cwd": DIR, "stdout": PATH, "stderr": PATH} and optionally "stdin": PATH (else /dev/null). The server forks a supervisor, which forks the job
and answers {"pid": JOB} then {"returncode": N} (negative: killed by that signal) once the job
has ended; the server itself never waits, so ranks of one check run side by side. The job is the
script as `python SCRIPT ARG...` runs it: its own process group, the request's environment,
working folder, argv, sys.path[0], input and output files, fresh random seeds, `__main__`, the exit
code of SystemExit or 1 after a traceback, atexit handlers run.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import threading
import traceback
import types


def _reseed() -> None:
    """A fresh process draws its own seeds; forked copies would share the server's (the standard
    library's `random` reseeds itself in a forked child, numpy's and torch's do not)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _run_job(request: dict) -> int:
    """In the forked job: become `python argv...` and run it; the exit code."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stdin = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
    if stdin != 0:
        os.dup2(stdin, 0)
        os.close(stdin)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _reseed()
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _supervise(conn: socket.socket, request: dict) -> None:
    """In the forked supervisor: fork the job, report its pid, wait, report its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os._exit(_run_job(request))
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _read_request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed the connection before its request ended")
        data += chunk
    return json.loads(data)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(path: str, watch: int, modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies only this thread: the jobs would lack the others
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(f"forkserver: importing {modules} started threads {names}; cannot fork safely")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped: leave through the clean-up
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    try:
        _serve(listener, watch)
    finally:
        _remove(os.path.dirname(path))


def _serve(listener: socket.socket, watch: int) -> None:
    while _alive(watch):
        readable, _, _ = select.select([listener], [], [], 1.0)
        if not readable:
            continue
        conn, _ = listener.accept()
        try:
            request = _read_request(conn)
        except (ConnectionError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            try:
                _supervise(conn, request)
            finally:
                os._exit(0)
        conn.close()


def _remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(folder))  # the run's folder, once its last server has gone
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
