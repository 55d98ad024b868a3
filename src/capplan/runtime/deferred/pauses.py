"""How long a serving step may wait on a deferred capture: the operator's bound.

Two settings, given to `capplan apply` (`--step-pause-ms`, `--slow-capture-every-steps`) and
passed to the engine in the environment; no vLLM here (the launcher checks them too).

- The step pause bound (default 50 ms): a step waits for a deferred capture only when that
  capture is expected to take at most this long (the slowest of its mode's recent captures).
- The slow-capture spacing N (default 100 steps; 0: never): a graph the traffic has missed, whose
  capture is expected to take longer, is still captured before a step, within a token bucket:
  in any run of S steps at most `SLOW_BURST` (8) + S / N such captures. A quiet stretch of 8 x N
  steps fills the bucket, and up to 8 then run on consecutive capture turns (each `every_steps`-th
  step); after that, one per N steps. Under sustained load the engine core is never idle, and
  captures of an 8B model took 79 to 236 ms (host-bound): left to idle turns, the graphs the load
  needed landed only after it ended. A missed graph is worth a pause once (each later step that
  would use it replays a padded fallback, or runs eager), so the number of paused steps is the
  number of graphs the traffic missed whatever the spacing; the spacing only sets when they land.
  Spaced by 100 steps alone (about 2.3 s a graph at 8B), the last graph the load used landed 40 to
  46 s after its first request; with the burst, the first 8 land on the first capture turns that
  miss them. Over a long run at most 1 in N steps waits on one, which leaves the 99th percentile
  of inter-token intervals to the steps that do not. Neither default has been measured against a
  full plan's latency under the same traffic on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from capplan.errors import EngineRefusal

STEP_PAUSE_MS = "CAPPLAN_STEP_PAUSE_MS"
SLOW_EVERY = "CAPPLAN_SLOW_CAPTURE_EVERY_STEPS"
DEFAULT_STEP_PAUSE_MS = 50.0
DEFAULT_SLOW_EVERY = 100
SLOW_BURST = 8  # slow captures a run may take at once before the spacing paces them
MAX_STEP_PAUSE_MS = 60_000.0
MIN_STEP_PAUSE_MS = 0.001  # a microsecond: a smaller one (1e-321 ms) is no pause once in seconds
MAX_SLOW_EVERY = 1_000_000


def pause_problem(step_pause_ms: float | None, slow_every: int | None) -> str | None:
    """Why these settings cannot be used (a line naming the option and its range), or None."""
    if step_pause_ms is not None and not MIN_STEP_PAUSE_MS <= step_pause_ms <= MAX_STEP_PAUSE_MS:
        return (
            f"--step-pause-ms {step_pause_ms:g}: give milliseconds from {MIN_STEP_PAUSE_MS:g} to {MAX_STEP_PAUSE_MS:g}"
        )
    if slow_every is not None and not 0 <= slow_every <= MAX_SLOW_EVERY:
        return f"--slow-capture-every-steps {slow_every}: give 0 (never) to {MAX_SLOW_EVERY} steps"
    return None


@dataclass(frozen=True)
class Pauses:
    step_pause_s: float = DEFAULT_STEP_PAUSE_MS / 1000
    slow_every_steps: int = DEFAULT_SLOW_EVERY  # 0: a slow capture never pauses a step
    slow_burst: int = SLOW_BURST  # slow captures a run may take at once before the spacing paces them

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Pauses:
        """The settings `capplan apply` passed (the defaults where it passed none); EngineRefusal
        for a value the launcher would have refused (the variable set by hand)."""
        try:
            ms = float(env[STEP_PAUSE_MS]) if STEP_PAUSE_MS in env else None
            every = int(env[SLOW_EVERY]) if SLOW_EVERY in env else None
        except ValueError:
            raise EngineRefusal(
                f"capplan: {STEP_PAUSE_MS}={env.get(STEP_PAUSE_MS)!r}, {SLOW_EVERY}={env.get(SLOW_EVERY)!r}: "
                "not numbers (set them through capplan apply --step-pause-ms and --slow-capture-every-steps)"
            ) from None
        problem = pause_problem(ms, every)
        if problem is not None:
            raise EngineRefusal(f"capplan: {problem}")
        return cls(
            DEFAULT_STEP_PAUSE_MS / 1000 if ms is None else ms / 1000, DEFAULT_SLOW_EVERY if every is None else every
        )
