"""Which vLLM release is running, its row in capplan's table (capplan.releases), and whether
a plan may run on it."""

from __future__ import annotations

from capplan.errors import UnsupportedVllm
from capplan.releases import RELEASES, Release, installed_release, runs_on

SUPPORTED = "vLLM " + ", ".join(RELEASES)


def detect_release(version: str) -> Release:
    """The table's row for a running vLLM (a local build suffix such as +cu130 is ignored);
    UnsupportedVllm naming the supported releases for anything else."""
    release = installed_release(version)
    if release is None:
        raise UnsupportedVllm(f"capplan: vLLM {version} is not supported; supported: {SUPPORTED}")
    return release


def release_problem(target: str, version: str) -> tuple[str, str] | None:
    """(why, fix) when a plan compiled for `target.vllm: target` cannot run on vLLM `version`; None
    when it can."""
    release = installed_release(version)
    if release is None:
        return f"vLLM {version} is not supported by capplan", f"install one of {SUPPORTED}"
    if release.version in runs_on(target):
        return None
    return (
        f"the plan was compiled for vLLM {target} (runs on {', '.join(runs_on(target))}), "
        f"not for vLLM {version}, which plans differently",
        f'recompile it with target.vllm: "{release.version}"',
    )
