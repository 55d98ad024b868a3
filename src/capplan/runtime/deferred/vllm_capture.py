"""vLLM's capture of one graph at a time, measured: its seconds and the device memory it took.

Each graph is captured in a call of vLLM's `ModelCudaGraphManager.capture` of its own, the
manager's capture list set to that graph alone for the call and put back after it
(`capture_list`, the one place deferred capture swaps vLLM's list; `set_capture_list` where the
list stays changed: the ready graphs, for vLLM's own capture and the report), so that each
one's memory is read. A
capture's memory is read from this process's own device memory where NVML gives it
(`device_memory`), else from the device's; the readings are counted each way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from capplan.runtime.deferred.device_memory import ProcessMemory, growth, in_use, open_for_current_device
from capplan.runtime.hooking import Call
from capplan.schemas.plan import address

if TYPE_CHECKING:
    from capplan.runtime.context import HookContext


@dataclass(frozen=True)
class Captured:
    """One capture: vLLM's result, its seconds (of them, `gpu_wait` waiting for the GPU's queued
    work) and the device memory it took."""

    result: Any
    seconds: float
    used: int
    gpu_wait: float = 0.0


def set_capture_list(manager: Any, descs: dict[Any, list[Any]]) -> None:
    """vLLM's capture list (its descriptors by mode) from here on."""
    manager._capture_descs = descs


@contextmanager
def capture_list(manager: Any, descs: dict[Any, list[Any]]) -> Iterator[None]:
    """vLLM's capture list set to `descs` inside, and the list it had put back after (an error
    included)."""
    kept = manager._capture_descs
    set_capture_list(manager, descs)
    try:
        yield
    finally:
        set_capture_list(manager, kept)


class CaptureOne(Protocol):
    """Capture plan graph `gid` through `capture_fn` (vLLM's capture) on `manager`."""

    def __call__(self, gid: int, call: Call, manager: Any, capture_fn: Any) -> Captured: ...


class VllmCapture:
    """The real `CaptureOne`: vLLM's capture, timed and measured."""

    def __init__(self, ctx: HookContext) -> None:
        self.ctx = ctx  # its vllm_descs: the plan's graphs as vLLM descriptors, in plan order
        self.memory: ProcessMemory | None = None  # NVML's view of this process's memory (None: the device's)
        self.memory_opened = False
        self.readings = {"process": 0, "device": 0}  # captures measured by this process's memory, by the device's

    def __call__(self, gid: int, call: Call, manager: Any, capture_fn: Any) -> Captured:
        import torch
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        cuda = torch.cuda.is_available()  # False only in capplan's CPU checks of the hooks
        desc = self.ctx.vllm_descs[gid]
        if cuda and not self.memory_opened:  # once, before the first capture is timed
            self.memory, self.memory_opened = open_for_current_device(), True
        with gpu_sync_allowed():
            started = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()  # the last step's GPU work, which the capture waits for anyway
            gpu_wait = time.perf_counter() - started
            before = in_use(self.memory) if cuda else (None, 0)
            try:
                with capture_list(manager, {desc.cg_mode: [desc]}):
                    result = call.run(capture_fn)
            except Exception as exc:
                raise RuntimeError(
                    f"capplan: capture of graph {address(self.ctx.plan.graphs[gid].descriptor)} failed "
                    f"({type(exc).__name__}: {exc}); the engine stops rather than serve from a graph pool in an "
                    "unknown state"
                ) from exc
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            used, own = growth(before, in_use(self.memory)) if cuda else (0, False)
            if cuda:
                self.readings["process" if own else "device"] += 1
        return Captured(result, seconds, used, gpu_wait)
