"""Dummy batches that warm up and capture each graph.

vLLM: the capture path's `create_forward_fn` (requests = desc.num_reqs or
min(tokens, max_num_seqs)), `InputBatch.make_dummy` and
`create_lora_capture_hook` (tokens per request), and
`LoRAModelRunnerMixin.maybe_select_dummy_loras` (adapter ids).
"""

from __future__ import annotations

from capplan.planner.lora_cases import kernel_grid
from capplan.schemas.plan import Descriptor, DummyLayout
from capplan.schemas.spec import Fix, Spec


def token_runs(num_tokens: int, num_reqs: int, spread: bool) -> list[tuple[int, int]]:
    """[requests, tokens each] runs summing to num_tokens.

    vLLM before 0.27 piles the remainder on the last request, which can make
    it longer than max_model_len (docs/design.md failure class 5); 0.27+
    and the `dummy_remainder` fix give one extra token to each of the last
    `remainder` requests instead.
    """
    base, extra = divmod(num_tokens, num_reqs)
    if extra == 0:
        return [(num_reqs, base)]
    if spread:
        runs = [(num_reqs - extra, base), (extra, base + 1)]
    else:
        runs = [(num_reqs - 1, base), (1, base + extra)]
    return [run for run in runs if run[0] > 0]


def dummy_lora_ids(case: int, spec: Spec) -> list[int] | None:
    """Adapter ids cycled over the dummy requests for a graph of LoRA case `case`.

    vLLM uses ids 1..min(case, max_loras) and, for the max_loras + 1 case,
    still only 1..max_loras: its comment promises -1 rows but the code never
    adds them, so with specialize_active the kernels record a grid of
    max_loras for that graph. Under `lora_slot` the case really includes the
    no-adapter slot, placed last so a one-request dummy still runs a real
    adapter (an all -1 batch would skip the kernels: failure class 1).
    """
    if not spec.lora.enabled:
        return None
    if case == 0:
        return [-1]
    max_loras = spec.lora.max_loras
    ids = list(range(1, min(case, max_loras) + 1))
    if case > max_loras and spec.has(Fix.lora_slot):
        ids.append(-1)
    return ids


class DummyLayouts:
    """Dummy layouts for one spec, memoized: graphs of the same size, request
    count and case (a PIECEWISE and a FULL graph, say) share one immutable
    layout, and token runs, adapter ids and kernel grids are each computed
    once per distinct input."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.max_num_seqs = spec.scheduler.max_num_seqs
        self.spread = spec.rules.spreads_dummy_remainder or spec.has(Fix.dummy_remainder)
        self._ids: dict[int, list[int] | None] = {}
        self._grids: dict[tuple[int, int], int | None] = {}
        self._runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._layouts: dict[tuple[int, int, int], DummyLayout] = {}

    def __call__(self, desc: Descriptor) -> DummyLayout:
        num_tokens, case = desc.num_tokens, desc.num_active_loras
        num_reqs = desc.num_reqs or min(num_tokens, self.max_num_seqs)
        layout = self._layouts.get((num_tokens, num_reqs, case))
        if layout is None:
            layout = self._layouts[num_tokens, num_reqs, case] = self._build(num_tokens, num_reqs, case)
        return layout

    def _build(self, num_tokens: int, num_reqs: int, case: int) -> DummyLayout:
        runs = self._runs.get((num_tokens, num_reqs))
        if runs is None:
            runs = self._runs[num_tokens, num_reqs] = token_runs(num_tokens, num_reqs, self.spread)
        if case not in self._ids:
            self._ids[case] = dummy_lora_ids(case, self.spec)
        ids = self._ids[case]
        grid_key = (case, min(num_reqs, len(ids) if ids else 0))
        if grid_key not in self._grids:
            self._grids[grid_key] = None if ids is None else kernel_grid(ids, num_reqs, self.spec)
        return DummyLayout.trusted(
            num_reqs=num_reqs,
            tokens=runs,
            max_query_len=runs[-1][1],
            lora_ids=ids,
            kernel_grid=self._grids[grid_key],
        )
