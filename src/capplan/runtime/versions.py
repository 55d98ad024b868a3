"""Which vLLM release is running, and the planning semantics it plans with (capplan.releases)."""

from __future__ import annotations

from capplan.errors import UnsupportedVllm
from capplan.releases import SUPPORTED_RELEASES

SUPPORTED = "vLLM " + ", ".join(SUPPORTED_RELEASES)


def detect_semantics(version: str) -> str:
    """'0.25' or '0.33' for a supported vLLM release (a local build suffix such as +cu130 is
    ignored); UnsupportedVllm naming the supported releases for anything else."""
    release = version.split("+", 1)[0]
    semantics = SUPPORTED_RELEASES.get(release)
    if semantics is None:
        raise UnsupportedVllm(f"capplan: vLLM {version} is not supported; supported: {SUPPORTED}")
    return semantics
