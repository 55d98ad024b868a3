"""Deferred capture on Model Runner V2 (spec `tiers`): the plan's ready graphs before the
engine reports ready, the deferred ones one at a time while it serves.

The rules that make it safe (docs/design.md, "Deferred capture", gives the reasons):

- Only captured graphs are dispatched: a batch whose graph is pending replays the first
  captured graph of its chain (`graphs`), which `capplan verify` proves replays it.
- A capture runs between model-runner steps, never inside one (`serving`).
- Every rank of an engine captures the same graphs at the same point of the step sequence;
  what a rank reads of its memory decides nothing alone (`ranks`).
- The KV cache is allocated before any capture; what the deferred graphs will take is held
  back as one block (`held`), sized by measured captures (`estimate`).
- One capture stream, and one lock between a capture and the async output thread (`hooks`).

Refused where it cannot be made safe: speculative decoding (vLLM captures the drafter's
graphs with the model's), and DP ranks that pad to one another under pipeline parallelism.

`DeferredCapture` is what the other hooks see (`context.Deferral`): one `DeferredState`
(`state`) that the start-up captures (`startup`) and the serving-time ones (`serving`) act on,
and its report section (`section`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Unpack

from capplan.runtime.deferred.section import section
from capplan.runtime.deferred.serving import Serving
from capplan.runtime.deferred.startup import StartUp
from capplan.runtime.deferred.state import DeferredState, Seams
from capplan.runtime.hooking import Call

if TYPE_CHECKING:
    from capplan.runtime.context import HookContext


class DeferredCapture:
    """Deferred capture in one worker process, as the other hooks ask of it (`seams`: what a
    check stands in for, `state.Seams`)."""

    def __init__(self, ctx: HookContext, **seams: Unpack[Seams]) -> None:
        self.state = DeferredState(ctx, **seams)
        self.startup = StartUp(self.state)
        self.serving = Serving(self.state)
        self.lock: threading.Lock = self.state.lock
        self.synced = self.state.synced

    @property
    def active(self) -> bool:
        return self.state.active

    @property
    def pending(self) -> list[int]:
        return self.state.graphs.pending

    @property
    def runner(self) -> Any:
        return self.state.runner

    @runner.setter
    def runner(self, runner: Any) -> None:
        self.state.runner = runner

    @property
    def profiling_extra(self) -> int:
        return self.state.start.profiling_extra

    def resolve(self, graph_id: int, traffic: bool = True) -> int:
        """The graph a batch dispatched to `graph_id` replays now; `traffic`: a step of real
        requests, whose miss of a pending graph counts (and is written to the report)."""
        graphs = self.state.graphs
        if traffic and graph_id not in graphs.captured:
            self.state.ctx.report.changed()
        return graphs.resolve(graph_id, traffic)

    def warm_attention(self, call: Call) -> None:
        self.startup.warm_attention(call)

    def ready_only(self, manager: Any) -> None:
        self.startup.ready_only(manager)

    def profile_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        return self.startup.profile_ready(manager, capture_fn, call)

    def capture_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any:
        return self.startup.capture_ready(manager, capture_fn, call)

    def before_step(self, runner: Any) -> None:
        self.serving.before_step(runner)

    def capture_idle(self) -> int:
        return self.serving.capture_idle()

    def to_json(self) -> dict[str, Any]:
        return section(self.state)
