"""The memory held for the deferred graphs still pending: one block of device memory, given
back to the driver for each capture and held again for the graphs left.

Invariant: at most one block is held; none while a capture runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from capplan.releases import CUDART
from capplan.runtime.hooking import Hook, check_attributes

HELD_BLOCK_HOOK = Hook(
    "deferred.held_block",
    f"{CUDART}.cudaMalloc",
    "the memory held for the deferred graphs is device memory outside PyTorch's caching allocator, given "
    "back to the driver for each capture without emptying the serving steps' cached blocks",
    attributes=("lib",),  # the runtime library, whose last error a refused cudaMalloc leaves set
)


class HeldBlock:
    """Device memory outside PyTorch's caching allocator (vLLM's `CudaRTLibrary`: cudaMalloc,
    cudaFree). Given back, it goes straight to the driver, where the graph pool can take it.
    Held as a PyTorch tensor it could be given back only through `torch.cuda.empty_cache()`,
    which also hands back every cached block of the serving steps, which the steps after it
    then take from the driver again (a cudaMalloc in a step)."""

    def __init__(self, library: Any, pointer: Any, size: int) -> None:
        self.library, self.pointer, self.size = library, pointer, size

    @classmethod
    def take(cls, size: int, free: int, library: Any = None) -> HeldBlock | None:
        """`size` bytes of device memory, or None where `free` (the device's free bytes now)
        is less or the driver refuses; a refusal leaves no CUDA error behind (PyTorch reads
        the runtime's last error after each kernel launch)."""
        if size > free:
            return None
        if library is None:
            from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

            library = CudaRTLibrary()
            check_attributes(HELD_BLOCK_HOOK, library)
        try:
            return cls(library, library.cudaMalloc(size), size)
        except RuntimeError:
            library.lib.cudaGetLastError()  # cudaErrorMemoryAllocation, cleared
            return None

    def give_back(self) -> None:
        self.library.cudaFree(self.pointer)


TakeBlock = Callable[[int, int], "HeldBlock | None"]
"""`HeldBlock.take(size, free)`, or a stand-in for it."""


class Hold:
    """The block held for the graphs still pending, and what was held over the run."""

    def __init__(self, take_block: TakeBlock | None = None) -> None:
        self.take_block: TakeBlock = take_block or HeldBlock.take
        self.block: HeldBlock | None = None
        self.held_bytes = 0  # its size now
        self.peak_bytes = 0  # the most ever held (at start, unless a capture raised the estimate)
        self.shortfall = False  # the estimate could not be held again while serving

    def release(self) -> None:
        """Give the block back to the driver, for the capture about to run."""
        if self.block is not None:
            self.block.give_back()
            self.block = None
            self.held_bytes = 0

    def take(self, want: int, free: int) -> bool:
        """Hold `want` bytes of the device's `free` in place of what is held now; whether it is
        held (nothing wanted counts as held). Not counted until `kept`."""
        self.release()
        self.block = self.take_block(want, free) if want > 0 else None
        return want <= 0 or self.block is not None

    def kept(self, want: int) -> None:
        """The block `take` held for `want` bytes stays held."""
        self.held_bytes = want if self.block is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
