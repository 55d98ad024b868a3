"""What the deferred graphs are held: a bound per graph and mode from measured captures.

Pure arithmetic on byte counts (no torch, no vLLM), so every rule here is testable with
readings alone. A capture's memory moves in whole allocation granules, so one graph's reading
says little but a run of them sums to within one granule of what they took.

- Readings come from captures that each measure one graph (each in a call of its own), per
  mode (PIECEWISE, FULL): the ready graphs and a spread sample of the deferred ones, made
  before the engine is ready; then each deferred graph as it lands.
- Each mode's first capture is left out: it allocates the pool's base (and FULL's output
  buffer), not a graph's memory.
- A mode is held by its deferred graphs' readings once it has `SAMPLES_MIN` of them, by the
  ready ones' with them before that (a ready graph is the largest of its kernel class: no
  sample of the deferred ones).
- Per graph: the readings' total plus the largest one, over their count (`per_graph_bound`);
  never less while serving than what the start held per graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MODES = ("PIECEWISE", "FULL")

SAMPLES_MIN = 24
"""How many deferred graphs of each mode are captured before the engine is ready, at the least,
as samples of what the deferred graphs take (all of them where a mode has fewer; at the start-up
capture at most half, and none for DP ranks that pad to one another), and the size of each round
of samples. Every rank of an engine captures the same ones; each costs one capture before the
engine is ready."""
SAMPLES_MAX = 128
"""The most deferred graphs of one mode sampled by their spread (see `sampled_enough`), and the
most the start-up capture takes after a profiling pass as they take no memory."""
SAMPLE_SPREAD = 10
"""A mode is sampled until its largest reading is at most 1/SAMPLE_SPREAD of their total (with
several TP or PP ranks, on every rank; not by DP ranks that pad to one another), so that the
bound (`per_graph_bound`: the total plus the largest, over the count) is at most 1.1 times the
readings' mean. Graphs smaller than one granule each need many readings."""


def per_graph_bound(sizes: Sequence[int]) -> int:
    """What each of many more graphs of one mode is held: the measured captures' total plus the
    largest single one, over their count (memory given back counts as none; 0 with none). The
    largest reading covers the one granule a run of readings can fall short by. An upper
    confidence limit from the readings' spread is looser for such readings (they are not
    independent: a graph that opens a granule leaves room for the next ones)."""
    use = [max(size, 0) for size in sizes]
    if not use:
        return 0
    return int(math.ceil((sum(use) + max(use)) / len(use)))


def spread_sample(ids: Sequence[int], k: int) -> list[int]:
    """`k` of `ids` (all of them where there are no more), evenly spaced over them, in order."""
    if len(ids) <= k:
        return list(ids)
    return [ids[(i * len(ids)) // k] for i in range(k)]


def sampled_enough(sizes: Sequence[int], fixed: bool) -> bool:
    """Whether a mode's readings so far are enough to hold its deferred graphs: `SAMPLES_MIN` of
    them; unless `fixed`, also the largest at most 1/`SAMPLE_SPREAD` of their total (all of them
    none counts as that), up to `SAMPLES_MAX`. `fixed` (DP ranks that pad to one another, whose
    readings no collective of capplan's joins): `SAMPLES_MIN`, whatever they read."""
    if len(sizes) < SAMPLES_MIN:
        return False
    if fixed or len(sizes) >= SAMPLES_MAX:
        return True
    use = [max(size, 0) for size in sizes]
    return max(use) * SAMPLE_SPREAD <= sum(use)


class Estimate:
    """The readings of one process's captures, by mode, and the bound they give."""

    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = {}  # deferred graphs' readings: sampled, then each landed
        self.ready_readings: dict[str, list[int]] = {}  # ready graphs' readings of the sampled pass
        self.firsts: dict[str, int] = {}  # each mode's first capture of the sampled pass (the pool's base)
        self.start_per_graph: dict[str, int] = {}  # the per-graph bound of each mode the start held
        self.start_readings: dict[str, list[int]] = {}  # the readings it rested on

    def reading(self, mode: str, used: int, *, deferred: bool) -> None:
        """One capture's memory in the sampled pass (profiling or start-up): each mode's first
        is the pool's base, not a graph's."""
        if mode not in self.firsts:
            self.firsts[mode] = used
        else:
            (self.samples if deferred else self.ready_readings).setdefault(mode, []).append(used)

    def landed(self, mode: str, used: int) -> None:
        """A deferred graph captured while serving: one more reading of its mode."""
        self.samples.setdefault(mode, []).append(used)

    def enough(self, mode: str, fixed: bool) -> bool:
        """`sampled_enough` of `mode`'s deferred readings."""
        return sampled_enough(self.samples.get(mode, []), fixed)

    def room(self, mode: str) -> int:
        """How many more deferred readings of `mode` sampling may take (`SAMPLES_MAX` in all)."""
        return SAMPLES_MAX - len(self.samples.get(mode, []))

    def hold_readings(self, mode: str) -> list[int]:
        """The readings `mode`'s deferred graphs are held by: its deferred graphs' own, once there
        are `SAMPLES_MIN` of them; before that, the ready graphs' too."""
        own = self.samples.get(mode, [])
        return own if len(own) >= SAMPLES_MIN else [*self.ready_readings.get(mode, []), *own]

    def per_graph_bytes(self, mode: str) -> int:
        """What one more graph of `mode` is held (`per_graph_bound` of its readings); of every
        mode's readings where it has none yet, of the first captures where no mode has any. Never
        less than what the start held per graph: the bound's added reading covers one run of
        captures (the sampled pass) falling a granule short of what it took, and the graphs
        landed since are another run, which could pull the mean below what the graphs take."""
        readings = self.hold_readings(mode) or [u for m in MODES for u in self.hold_readings(m)]
        return max(per_graph_bound(readings or list(self.firsts.values())), self.start_per_graph.get(mode, 0))

    def fix_start_bounds(self) -> None:
        """As the start-up capture ends: each mode's per-graph bound (and the readings it rests
        on), below which it is never held while serving."""
        self.start_per_graph = {m: self.per_graph_bytes(m) for m in MODES}
        self.start_readings = {m: list(r) for m in MODES if (r := self.hold_readings(m))}

    def bound(self, modes: Sequence[str]) -> int:
        """What graphs of these modes (one entry a graph) are held: each mode's per-graph bound,
        times its count."""
        return sum(self.per_graph_bytes(mode) * modes.count(mode) for mode in sorted(set(modes)))
