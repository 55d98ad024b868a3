"""What a capture takes of the GPU's memory, read so that other processes on the GPU do not
enter it.

The device's free memory (cudaMemGetInfo) moves with every process on the GPU, so a hold sized
from it is no bound where other engines share the GPU. NVML accounts each process's device
memory on its own (`usedGpuMemory` of `nvmlDeviceGetComputeRunningProcesses`), moving by what
this process allocates alone (docs/benchmarks.md, "Deferred capture: the rules and what led to
them", has the runs). So a capture reads this process's own memory where NVML gives it before
and after the capture, and the device's where it does not (no NVML, a device NVML does not
find, a container whose PIDs NVML does not share, no value, a listing that fails, a figure
below what PyTorch alone holds: another process's under the same PID). The report counts the
captures read each way.
"""

from __future__ import annotations

import os
from typing import Any


class ProcessMemory:
    """This process's device memory and the GPU's other processes, from NVML (vLLM's copy of
    pynvml), kept open while the process serves (an NVML call costs well under a millisecond,
    opening it more)."""

    def __init__(self, nvml: Any, handle: Any, pid: int) -> None:
        self.nvml, self.handle, self.pid = nvml, handle, pid

    @classmethod
    def open(cls, device_uuid: str) -> ProcessMemory | None:
        """NVML's view of the GPU with this UUID (torch's, which lacks NVML's `GPU-`, or NVML's
        own), or None where NVML cannot give one (no NVML, a device it does not find: it is shut
        again). A MIG instance's UUID as torch gives it is not found: its captures are read by
        the device's memory."""
        try:
            from vllm.utils.import_utils import import_pynvml

            nvml = import_pynvml()
            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no NVML: the device's reading is used
            return None
        uuid = device_uuid if device_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{device_uuid}"
        try:
            return cls(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid), os.getpid())
        except Exception:  # noqa: BLE001
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - nothing more to give back
                pass
            return None

    def listed(self) -> dict[int, int | None] | None:
        """Each process NVML lists on the GPU, with the bytes it uses (None: NVML does not say);
        None where the listing fails."""
        try:
            return {p.pid: p.usedGpuMemory for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)}
        except Exception:  # noqa: BLE001
            return None

    def own(self) -> int | None:
        """The device memory this process uses, or None where NVML does not list it."""
        used = (self.listed() or {}).get(self.pid)
        return used if type(used) is int else None

    def others(self) -> int | None:
        """How many other processes hold memory on the GPU, or None where NVML cannot tell. Where
        NVML does not list this process (a container whose PIDs it does not share), one of those
        it lists may be this process under another PID: at least all but one are others, and
        with one or none listed it cannot tell."""
        listed = self.listed()
        if listed is None:
            return None
        if self.pid in listed:
            return len(listed) - 1
        return len(listed) - 1 if len(listed) > 1 else None


def open_for_current_device() -> ProcessMemory | None:
    """`ProcessMemory` of the GPU this process captures on (None without one)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:  # noqa: BLE001
        return None
    return ProcessMemory.open(uuid)


def in_use(memory: ProcessMemory | None) -> tuple[int | None, int]:
    """The device memory in use outside PyTorch's default pool, read two ways: this process's
    (None where NVML does not give it, or gives less than PyTorch alone holds) and the
    device's. Outside the default pool lie the CUDA-graph pools' segments and what the driver
    holds beside the caching allocator (each graph's executable among it), so a capture's
    memory is this measure's growth. The default pool is left out: its cached blocks come and
    go with the steps between captures and with the `torch.cuda.empty_cache()` that
    `torch.cuda.graph` runs as a capture starts, and none of them is a graph's."""
    import torch

    device = torch.cuda.current_device()
    default = sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if s.get("device", device) == device and tuple(s["segment_pool_id"]) == (0, 0)
    )
    free, total = torch.cuda.mem_get_info()
    own = memory.own() if memory is not None else None
    if own is not None and own < torch.cuda.memory_reserved(device):
        own = None  # less than PyTorch alone holds here: not this process's figure
    return (None if own is None else own - default), int(total - free - default)


def growth(before: tuple[int | None, int], after: tuple[int | None, int]) -> tuple[int, bool]:
    """A capture's memory from the readings before and after it: this process's own where both
    have it (True), else the device's (False)."""
    if before[0] is not None and after[0] is not None:
        return after[0] - before[0], True
    return after[1] - before[1], False
