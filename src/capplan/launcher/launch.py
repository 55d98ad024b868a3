"""`capplan apply`: check that a command will really run vLLM with the plan, then run it.

Nothing here imports vLLM: the checks ask the Python that will run the
command, so a plan is never handed to an environment where it would be
silently ignored (no vLLM, no capplan plugin, the plugin filtered out, the
V1 model runner forced).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from capplan.envvars import RAY_PREFIXES, with_ray_prefix
from capplan.errors import CapplanError, printable
from capplan.install_hints import pip_install

_PROBE = (
    "import importlib.metadata as m, importlib.util as u\n"
    "has = u.find_spec('vllm') is not None\n"
    "try: version = m.version('vllm') if has else '-'\n"
    "except m.PackageNotFoundError: version = '-'\n"
    "print(has, any(e.name == 'capplan' for e in m.entry_points(group='vllm.general_plugins')), version)"
)


def target_python(command: list[str]) -> str | None:
    """The interpreter that will run `command`: the command itself when it is a Python, the
    interpreter of its shebang line when it is a script (`vllm`), else None."""
    exe = shutil.which(command[0]) or command[0]
    if Path(exe).name.startswith("python"):
        return exe
    import os
    import stat

    try:
        if not stat.S_ISREG(os.stat(exe).st_mode):  # a pipe or device: never opened (it could block)
            return None
        with open(exe, "rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if first.startswith("#!") and "python" in first:
        parts = first[2:].split()
        if parts and Path(parts[0]).name == "env":
            # `#!/usr/bin/env [-S] [-i] [VAR=value ...] python3 [-u]`: the first word that is
            # neither an option of env nor an assignment names the interpreter
            words = [w for w in parts[1:] if not w.startswith("-") and "=" not in w]
            return (shutil.which(words[0]) or words[0]) if words else None
        return parts[0] if parts else None
    return None


def check_environment(command: list[str], env: dict[str, str], target: str | None = None) -> dict[str, str]:
    """The environment to run `command` in, after refusing every setup where the plan
    would not be in force (with `target`, the plan's `target.vllm`: a vLLM release the
    plan was not compiled for too, before anything starts)."""
    if env.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        raise CapplanError(
            "VLLM_USE_V2_MODEL_RUNNER=0 puts the engine on vLLM's V1 model runner, where the plan cannot be in force",
            "unset it: capplan apply runs Model Runner V2",
        )
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "capplan" not in [p.strip() for p in plugins.split(",")]:
        raise CapplanError(
            f"VLLM_PLUGINS={printable(plugins)} leaves out capplan's plugin, so vLLM would not load the plan",
            "add capplan to VLLM_PLUGINS or unset it",
        )
    import os
    import stat

    exe = shutil.which(command[0])
    if exe is None:
        where = command[0]
        if "/" in where and os.path.isdir(where):
            raise CapplanError(f"{printable(where)}: is a directory, not a command")
        if "/" in where and os.path.exists(where):
            raise CapplanError(
                f"{printable(where)}: is not executable", f"chmod +x {printable(where)}, or run it with its interpreter"
            )
        raise CapplanError(f"{printable(where)}: command not found", "give the command that starts vLLM")
    if not stat.S_ISREG(os.stat(exe).st_mode):
        raise CapplanError(f"{printable(command[0])}: not a regular file (a pipe or device); cannot run it")
    python = target_python(command)
    if python is None:
        python = sys.executable  # a wrapper script: the best guess is the Python running capplan
    try:
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=60)
        found, plugin, version = probe.stdout.split()
        has_vllm, has_plugin = found == "True", plugin == "True"
    except (OSError, ValueError, subprocess.TimeoutExpired):
        raise CapplanError(
            f"cannot run {printable(python)} to check that it sees vLLM and capplan's plugin",
            "give a command that runs vLLM's Python",
        ) from None
    where = printable(python)
    if not has_vllm:
        raise CapplanError(
            f"vLLM is not installed for {where}, which runs the command", pip_install("vllm", python=where)
        )
    if not has_plugin:
        raise CapplanError(
            f"capplan's vLLM plugin is not installed for {where}, so vLLM would run without the plan",
            pip_install(python=where),
        )
    if target is not None and version != "-":
        from capplan.releases import release_problem

        problem = release_problem(target, version)
        if problem:
            raise CapplanError(f"{where}: {problem[0]}", problem[1])
    # MoE models before vLLM 0.29 default to the V1 runner; the plan needs MRV2. Some Ray actors
    # get only the environment variables vLLM lists for them: capplan's prefix joins that list.
    return {**env, "VLLM_USE_V2_MODEL_RUNNER": "1", RAY_PREFIXES: with_ray_prefix(env.get(RAY_PREFIXES))}


def run_child(command: list[str], env: dict[str, str]) -> int:
    """Run the command to its end, passing Ctrl-C and SIGTERM on; its exit code (128+N on a signal)."""
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise CapplanError(f"{printable(command[0])}: command not found") from None
    except OSError as exc:
        raise CapplanError(f"{printable(command[0])}: cannot run ({exc.strerror})") from None

    def forward(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - signal handler signature
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


__all__ = ["check_environment", "run_child", "target_python"]
