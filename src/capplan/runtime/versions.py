"""Which vLLM release is running: its row in capplan's table (capplan.releases). Whether a
plan may run on it is `capplan.releases.release_problem`, which the launcher asks too."""

from __future__ import annotations

from capplan.errors import UnsupportedVllm
from capplan.releases import SUPPORTED, Release, installed_release


def detect_release(version: str) -> Release:
    """The table's row for a running vLLM (a local build suffix such as +cu130 is ignored);
    UnsupportedVllm naming the supported releases for anything else."""
    release = installed_release(version)
    if release is None:
        raise UnsupportedVllm(f"capplan: vLLM {version} is not supported; supported: {SUPPORTED}")
    return release
