"""Capture sizes that hold up on traffic they were not fitted on: time-ordered folds.

A size set fitted exactly to a trace's token counts puts sizes where that
trace's batches fell; the next hour's batches fall between them and pad by up
to the gap. So `optimize` (padded-tokens objective) judges each way of
choosing sizes, not by how well it fits the steps it saw, but by how it does
on steps it did not see:

- the fitted part of the trace is cut into `BLOCKS` consecutive blocks of
  steps (time order, as the recorder writes them);
- for each block, sizes are chosen from the other blocks and scored on it
  (padded tokens), and the scores summed: every fitted step is scored once,
  by sizes that never saw it;
- each way of choosing is a number of sizes and a smoothing width: a step of
  t tokens counts, spread evenly, for every count within `width` x t of t
  (smoothing toward its observed neighbours, so sizes cover where batches
  are likely to fall, not only where they fell); `BANDWIDTHS` are tried;
- vLLM's default sizes are scored on the same steps, and stay a candidate.

The number of sizes and the width with the least summed score (per LoRA case,
under the graph budget) win; the sizes themselves are then fitted on the
whole fitted part with that width.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from capplan.traffic.simulate import TraceBatch

BLOCKS = 4
BANDWIDTHS = (0.0, 0.04)

Weights = dict[int, float]


def time_blocks(trace: list[TraceBatch], blocks: int = BLOCKS) -> list[list[TraceBatch]]:
    """The trace cut into `blocks` consecutive parts of (nearly) equal step counts, a run of
    repeats cut where it falls; fewer when the trace has fewer steps."""
    total = sum(item.count for item in trace)
    blocks = max(1, min(blocks, total))
    cuts = [round(total * (i + 1) / blocks) for i in range(blocks)]
    out: list[list[TraceBatch]] = [[] for _ in range(blocks)]
    seen, b = 0, 0
    for item in trace:
        left = item.count
        while left:
            room = cuts[b] - seen
            if room == 0:
                b += 1
                continue
            take = min(left, room)
            out[b].append(TraceBatch(item.batch, take, item.dp_step))
            seen += take
            left -= take
    return out


def smoothed(weights: Weights, width: float, top: int) -> Weights:
    """Each count's weight spread evenly over the counts within width x count of it (at most
    `top`, at least 1); width 0: the weights as they are."""
    if width <= 0:
        return dict(weights)
    out: Weights = {}
    for t, n in weights.items():
        reach = int(width * t)
        lo, hi = max(1, t - reach), min(top, t + reach)
        share = n / (hi - lo + 1)
        for u in range(lo, hi + 1):
            out[u] = out.get(u, 0.0) + share
    return out


def padded(sizes: list[int], weights: Weights) -> float:
    """Padded tokens of these weights under sizes (a count above the largest size runs eager
    and pads nothing)."""
    total = 0.0
    for t, n in weights.items():
        j = bisect.bisect_left(sizes, t)
        if j < len(sizes):
            total += n * (sizes[j] - t)
    return total


def add(a: Weights, b: Weights) -> Weights:
    out = dict(a)
    for t, n in b.items():
        out[t] = out.get(t, 0.0) + n
    return out


def held_out_scores(
    blocks: list[Weights],
    width: float,
    top: int,
    fit: Callable[[Weights], Callable[[int], list[int] | None]],
    ks: Sequence[int],
) -> list[float]:
    """For each k in `ks`: padded tokens of every block under the k sizes `fit` chooses from the
    other blocks (smoothed by `width`); `fit(weights)` gives a function of k returning the
    sizes, or None when no k sizes can be chosen (that k scores infinite)."""
    scores = [0.0 for _ in ks]
    for i, block in enumerate(blocks):
        if not block:
            continue
        rest: Weights = {}
        for j, other in enumerate(blocks):
            if j != i:
                rest = add(rest, other)
        choose = fit(smoothed(rest, width, top))
        for n, k in enumerate(ks):
            sizes = choose(k)
            scores[n] += float("inf") if sizes is None else padded(sizes, block)
    return scores
