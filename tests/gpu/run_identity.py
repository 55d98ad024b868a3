"""What every GPU result records about the run that made it: the capplan commit, vLLM, torch, the
GPU (and, from each server's log, the attention backend vLLM chose)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

# vLLM's line where it picks the backend ("Using FLASH_ATTN attention backend out of potential backends: ...")
# and where --attention-backend names it ("Using AttentionBackendEnum.TRITON_ATTN backend.")
BACKEND_LINE = re.compile(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend")


def capplan_commit() -> str | None:
    """The commit under test: `CAPPLAN_COMMIT` (the device scripts set it), else `git rev-parse HEAD`."""
    commit = os.environ.get("CAPPLAN_COMMIT")
    if not commit:
        got = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        commit = got.stdout.strip() or None
    return commit


def identity() -> dict:
    """The capplan commit, vLLM, torch, the GPU."""
    import torch

    return {
        "capplan_commit": capplan_commit(),
        "vllm": version("vllm"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "host_cpu": host_cpu(),
    }


def host_cpu() -> str:
    """The host's CPU model and logical cores (capture is host-bound: its seconds depend on it)."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown'} ({os.cpu_count()} cores)"
