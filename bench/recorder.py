"""The trace recorder's cost per step on the engine's step path, on CPU.

    python -m bench.recorder [NUM_REQS ...]

Times what capplan's execute_model wrapper does after each real step when
CAPPLAN_TRACE is set and the lora_slot hook already counted the step's
adapters: the longest request, then `Recorder.step` (a tuple queued; the
writer thread formats and writes). Prints microseconds per step, the number
the recorder itself reports as `overhead_us_per_step`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from capplan.runtime.recorder import Recorder

STEPS = 20_000


def per_step_us(num_reqs: int, folder: Path) -> tuple[float, float]:
    counts = {f"req-{i}": 1 for i in range(num_reqs)}
    rec = Recorder(str(folder / f"trace-{num_reqs}.jsonl"), 1 << 30, "bench")
    total = 0.0
    for _ in range(STEPS):
        started = time.perf_counter()
        max_q = max(counts.values())
        rec.step(num_reqs, num_reqs, max_q, 4, True, max_q > 1, started)
        total += time.perf_counter() - started
    rec.close()
    return 1e6 * total / STEPS, 1e6 * rec.seconds / rec.steps


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or [1, 32, 256]
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            wall, counted = per_step_us(n, Path(tmp))
            print(f"{n:>5} requests: {wall:.1f} us per step (the recorder counts {counted:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
