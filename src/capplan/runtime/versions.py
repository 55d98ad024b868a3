"""Which planning semantics a live vLLM has."""

from __future__ import annotations

SUPPORTED = "vLLM 0.25.x and 0.31-0.33"


def detect_semantics(version: str) -> str:
    """'0.25' or '0.33' for a vLLM version string; raises for anything else."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise RuntimeError(f"capplan: cannot read vLLM version {version!r}; supported: {SUPPORTED}") from None
    if (major, minor) == (0, 25):
        return "0.25"
    if major == 0 and 31 <= minor <= 33:
        return "0.33"
    raise RuntimeError(f"capplan: vLLM {version} is not supported; supported: {SUPPORTED}")
