"""Does NVML's per-process memory follow this process's allocations, and only them?

    python tests/gpu/nvml_probe.py      (on a GPU: vLLM's copy of pynvml, else nvidia-ml-py's)

Prints this process's memory as NVML lists it beside the device's used memory
(cudaMemGetInfo), as it allocates 100 MiB and 1 GiB, captures a CUDA graph, while another
process holds 3 GiB, and as it frees memory; and how long listing the processes takes. The
deferred-capture runtime reads each capture's memory this way (`capplan.runtime.deferred.
device_memory`), and falls back on the device's reading where NVML does not list the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

try:
    from vllm.third_party import pynvml as nvml
except ImportError:  # vLLM's copy is nvidia-ml-py's module
    import pynvml as nvml  # type: ignore[no-redef]

HOLD_OTHER = (
    "import torch, time; t = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda'); "
    "torch.cuda.synchronize(); print('up', flush=True); time.sleep(60)"
)


def main() -> None:
    torch.empty(1, device="cuda")
    nvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    me = os.getpid()

    def listed() -> dict[int, int]:
        return {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}

    def device() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    print("this process", me, "listed", me in listed(), listed())
    started = time.perf_counter()
    for _ in range(100):
        listed()
    print(f"listing the processes: {(time.perf_counter() - started) * 10:.3f} ms")
    rows = []

    def mark(what: str) -> None:
        torch.cuda.synchronize()
        rows.append((what, listed().get(me), device()))

    mark("start")
    a = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")
    mark("100 MiB allocated")
    b = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # noqa: F841 - held
    mark("1 GiB allocated")
    x, w = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            x @ w
    mark("before a graph")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(50):
            torch.relu(x @ w)
    mark("graph captured")
    other = subprocess.Popen([sys.executable, "-c", HOLD_OTHER], stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None
    other.stdout.readline()
    mark("another process holds 3 GiB")
    del a
    torch.cuda.empty_cache()
    mark("100 MiB freed")
    other.kill()
    other.wait()
    time.sleep(1)
    mark("the other process gone")
    _, own0, dev0 = rows[0]
    for what, own, dev in rows:
        own_mib = "not listed" if own is None or own0 is None else f"{(own - own0) / 2**20:9.1f} MiB"
        print(f"{what:30s} this process {own_mib:>14s}   device {(dev - dev0) / 2**20:9.1f} MiB")


if __name__ == "__main__":
    main()
