"""Run a script on the oracle's Python (the venv `.ci/run` prepares, torch on CPU and a release's
vLLM sources on the path): the one way the conformance tests start a check or a rank.

    job = start(["tests/conformance/x_worker.py", "0", port], version="0.33.0")
    job.wait(timeout=300); job.returncode, job.stdout, job.stderr

`run` is `start` then `wait`. The jobs of one release and environment are forked from one
server process (forkserver.py) that has imported that release's vLLM once in this test run, so a
check costs its own work, not vLLM's import again; the ranks of one check are jobs started side
by side. A job is what `python SCRIPT ARG...` with that environment would be. The run's servers
are shared by its xdist workers (the first that needs one starts it, under a lock) and end with
the run. Jobs whose environments differ in anything but CAPPLAN_* and PYTEST_* variables (vLLM
may read the others while it is imported) get different servers. CAPPLAN_ORACLE_FRESH=1 runs
every job as a fresh process instead (to compare the two ways, or to debug).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from capplan.launcher import vllm_cli
from tests.conformance import coverage

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
PYTHON = ORACLE_DIR / "venv" / "bin" / "python"
SERVER = Path(__file__).with_name("forkserver.py")
# What every vLLM check script imports first, in this order (runtime_check.py's first imports);
# a server of a path without vLLM imports torch only.
PRELOAD_VLLM = ("vllm", "vllm.v1.worker.gpu.cudagraph_utils", "vllm.v1.worker.gpu.model_runner")
PRELOAD_TORCH = ("torch",)
# Variables a job may set differently from its server: read by capplan and pytest, never by vLLM
# or torch while they are imported.
PER_JOB = ("CAPPLAN_", "PYTEST_")
START_TIMEOUT = 600
AS_CAPPLAN_RUNS_IT = vllm_cli.run_script  # a fresh process (the tests patch vllm_cli's)
FORKED_PARSER_RUNS: list[str] = []  # one entry per run_script call this process forked


def python_path(version: str | None) -> list[str]:
    """The release's vLLM sources (none for None), capplan's sources, the repository root."""
    head = [str(ORACLE_DIR / "src" / version)] if version else []
    return [*head, str(ROOT / "src"), str(ROOT)]


class Job:
    """One script on the oracle's Python: `wait` for its exit code; its output as text then."""

    def __init__(self, argv: list[str], out: Path, conn: socket.socket | None = None, proc=None) -> None:
        self.argv, self._out, self._conn, self._proc = argv, out, conn, proc
        self._reader = conn.makefile("rb") if conn is not None else None
        self.pid = proc.pid if proc is not None else int(_read_line(self._reader)["pid"])
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def wait(self, timeout: float = 600) -> int:
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = self._wait(timeout)
        except (subprocess.TimeoutExpired, TimeoutError):
            self.kill()
            self._finish()
            raise subprocess.TimeoutExpired(self.argv, timeout, self.stdout, self.stderr) from None
        self._finish()
        return self.returncode

    def kill(self) -> None:
        """Kill the job (its process group: what it started too), if it still runs."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._finish()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.returncode is None:
            self._finish()

    def _wait(self, timeout: float) -> int:
        if self._proc is not None:
            return self._proc.wait(timeout)
        assert self._conn is not None and self._reader is not None
        self._conn.settimeout(timeout)
        return int(_read_line(self._reader)["returncode"])

    def _finish(self) -> None:
        if self._conn is not None:
            self._reader.close()
            self._conn.close()
            self._conn = self._reader = None
        if self._out.exists():
            self.stdout = (self._out / "stdout").read_text(errors="replace")
            self.stderr = (self._out / "stderr").read_text(errors="replace")
            shutil.rmtree(self._out, ignore_errors=True)


def start(
    argv: list[str],
    *,
    version: str | None,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    stdin: Path | None = None,
    extra_path: tuple[str, ...] = (),
) -> Job:
    """Start `python argv...` on the oracle's Python with `version`'s vLLM on the path (after
    capplan's sources and the root, then `extra_path`), reading `stdin` (default: nothing); `env`
    (default: this process's) gets that PYTHONPATH."""
    path = [*python_path(version), *extra_path]
    env = {**(os.environ if env is None else env), "PYTHONPATH": os.pathsep.join(path)}
    argv = [str(a) for a in argv]
    coverage.compared("checks", Path(argv[0]).name if argv[0] != "-c" else "-c", version or "-", {"runs": 1})
    address = None if os.environ.get("CAPPLAN_ORACLE_FRESH") == "1" else _server(path, version, env)
    out = Path(tempfile.mkdtemp(prefix="capplan-job-"))  # the job's output, removed once it is read
    try:
        if address is None:
            with (
                open(stdin or os.devnull) as given,
                open(out / "stdout", "w") as stdout,
                open(out / "stderr", "w") as stderr,
            ):
                proc = subprocess.Popen(
                    [str(PYTHON), *argv], env=env, cwd=cwd, stdin=given, stdout=stdout, stderr=stderr
                )
            return Job(argv, out, proc=proc)
        (out / "stdout").touch()
        (out / "stderr").touch()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(60)
        conn.connect(str(address))
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "stdout": str(out / "stdout"),
            "stderr": str(out / "stderr"),
            "stdin": None if stdin is None else str(stdin),
        }
        conn.sendall(json.dumps(request).encode() + b"\n")
        return Job(argv, out, conn)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def run(argv: list[str], *, version: str | None, env: dict[str, str] | None = None, timeout: float = 600) -> Job:
    """`start` then `wait`: the ended job."""
    job = start(argv, version=version, env=env)
    job.wait(timeout)
    return job


_KNOWN: dict[str, int] = {}  # the servers this process has used: folder key -> server pid
_STARTED: list[subprocess.Popen] = []


def run_script(python: str, script: str, stdin: str, env: dict[str, str], timeout: float) -> str:
    """`capplan.launcher.vllm_cli.run_script` as a job of the run's fork server, where `python` is
    the oracle's and PYTHONPATH starts with a release's vLLM sources (its other entries follow
    capplan's sources and the root on the job's path); any other call runs as capplan runs it.
    The conformance tests of vLLM's argument parser patch it in, so that each release's vLLM is
    imported once per environment for the run, not once per corpus; `test_vllm_parser.py`
    checks the two ways give the same answers."""
    path = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not path or Path(python) != PYTHON or Path(path[0]).resolve().parent != (ORACLE_DIR / "src").resolve():
        return AS_CAPPLAN_RUNS_IT(python, script, stdin, env, timeout)
    with tempfile.NamedTemporaryFile("w", prefix="capplan-stdin-", suffix=".json") as given:
        given.write(stdin)
        given.flush()
        job = start(
            ["-c", script], version=Path(path[0]).name, env=env, stdin=Path(given.name), extra_path=tuple(path[1:])
        )
        job.wait(timeout)
    FORKED_PARSER_RUNS.append(job.argv[0])
    return job.stdout


def _run_dir() -> Path:
    """Where this test run's servers listen: one folder per run, shared by its xdist workers."""
    run = (os.environ.get("PYTEST_XDIST_TESTRUNUID") or "")[:12] or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"capplan-forkservers-{run}"  # short: a socket's path has 107 bytes


def _watched() -> int:
    """The process whose end ends the servers: xdist's controller (a worker's parent), else this one."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_TESTRUNUID") else os.getpid()


def _shared(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(PER_JOB)}


def _server(path: list[str], version: str | None, env: dict[str, str]) -> Path:
    """The socket of the run's server for `path` and `env` (but its PER_JOB variables), started
    by the first process of the run that needs it."""
    key = hashlib.sha256(json.dumps([path, sorted(_shared(env).items())]).encode()).hexdigest()[:16]
    folder = _run_dir() / key
    if key in _KNOWN:
        return folder / "socket"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process starts it; the others wait for it here
        ready = folder / "ready"
        if not ready.exists():
            _start_server(folder, PRELOAD_VLLM if version else PRELOAD_TORCH, env)
        _KNOWN[key] = int(ready.read_text())
    return folder / "socket"


def _start_server(folder: Path, preload: tuple[str, ...], env: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "socket").unlink(missing_ok=True)
    with open(folder / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [str(PYTHON), str(SERVER), str(folder / "socket"), str(_watched()), *preload],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,  # outlives the worker that started it, until the run ends
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    line = b""
    while line.strip() != b"ready":
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else b""
        if not line:
            proc.kill()
            proc.wait()
            err = (folder / "stderr").read_text(errors="replace")[-3000:]
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                folder.parent.rmdir()
            raise RuntimeError(f"the oracle's fork server ({' '.join(preload)}) did not start:\n{err}")
    proc.stdout.close()
    _STARTED.append(proc)
    (folder / "ready").write_text(str(proc.pid))


def _read_line(reader) -> dict:
    line = reader.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the oracle's fork server closed the connection")
    return json.loads(line)
