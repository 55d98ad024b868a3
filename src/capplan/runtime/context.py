"""The context capplan's hooks share in one vLLM engine or worker process.

Words: "engine" is vLLM's (the engine core and its workers); capplan's per-process state
is the hook context, `HookContext`, named `ctx` wherever it is passed. It is built once per
process by `registry.install` and given to every installer: the plan, vLLM's descriptors for
its graphs, the report. `Step` holds what one
model-runner step's hooks tell each other (what vLLM told its dispatcher, the LoRA count,
the DP step), written by the hook that learns it and read by the ones after it in the
same step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from capplan.calibration.budget import GraphBudget
from capplan.planner.dispatch import Dispatcher
from capplan.releases import Release
from capplan.runtime.hooking import Call
from capplan.runtime.launch_line import Reading
from capplan.runtime.recorder import Recorder
from capplan.runtime.report import Report
from capplan.schemas.plan import DummyLayout, Plan


class Deferral(Protocol):
    """What the other hooks ask of deferred capture (capplan.runtime.deferred.capture)."""

    lock: threading.Lock  # held by a capture: the async output thread waits on it
    runner: Any  # vLLM's model runner, whose LoRA manager warms a deferred LoRA graph
    synced: bool  # DP ranks that pad to one another: captures at DP-synced steps, dummy steps too

    @property
    def active(self) -> bool: ...  # the ready graphs are captured
    @property
    def pending(self) -> list[int]: ...
    @property
    def profiling_extra(self) -> int: ...  # bytes added to vLLM's CUDA-graph memory estimate

    def resolve(self, graph_id: int, traffic: bool = True) -> int: ...
    def warm_attention(self, call: Call) -> None: ...
    def ready_only(self, manager: Any) -> None: ...
    def profile_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any: ...
    def capture_ready(self, manager: Any, capture_fn: Any, call: Call) -> Any: ...
    def before_step(self, runner: Any) -> None: ...
    def capture_idle(self) -> int: ...
    def to_json(self) -> dict[str, Any]: ...


@dataclass
class Step:
    """One model-runner step, as its hooks see it."""

    inside: bool = False  # within vLLM's dispatch-and-DP-sync call: the step wrapper counts what runs
    has_prefill: bool | None = None  # what vLLM told its dispatcher (releases with max_query_len)
    lora: tuple[int, bool] | None = None  # (adapters, base) the lora_slot hook counted
    dp_step: int = -1  # steps through DP sync so far, idle and warm-up steps too (alike on every rank)
    warmup: bool = False  # vLLM's own warm-up step (its request ids): no traffic, no deferred graph missed

    def start(self) -> None:
        self.has_prefill = self.lora = None


@dataclass
class Recording:
    """The trace recorder's state in this process (CAPPLAN_TRACE)."""

    recorder: Recorder | None = None
    off: bool = False  # a tensor-parallel worker other than rank 0: it records nothing


@dataclass
class HookContext:
    """Everything capplan's hooks share in one process."""

    plan: Plan
    plan_path: str
    release: Release
    dispatcher: Dispatcher
    report: Report
    desc_cls: Any  # vLLM's BatchExecutionDescriptor
    vllm_descs: list[Any]  # the plan's graphs as vLLM descriptors, in plan order
    layouts: dict[tuple[int, int, int], DummyLayout]  # (tokens, requests, LoRA case) -> the graph's dummy batch
    step: Step = field(default_factory=Step)
    recording: Recording = field(default_factory=Recording)
    deferred: Deferral | None = None  # spec tiers: the graphs captured while serving
    in_force: bool = False  # set once the plan's capture list is installed
    launch: Reading = field(default_factory=Reading)  # the server's own command read (CAPPLAN_COMMAND)
    graph_budget: GraphBudget | None = None  # the graph memory a calibration left beside the KV cache
    lora_state_checked: bool = False
    capture_each: bool = False  # CAPPLAN_CAPTURE_EACH: each graph of the one capture measured (`capplan calibrate`)


def layouts_of(plan: Plan) -> dict[tuple[int, int, int], DummyLayout]:
    return {(g.descriptor.num_tokens, g.dummy.num_reqs, g.descriptor.num_active_loras): g.dummy for g in plan.graphs}


_CURRENT: list[HookContext] = []  # this process's, once installed


def current() -> HookContext | None:
    """This process's context, or None before the plan is installed (or without one)."""
    return _CURRENT[0] if _CURRENT else None


def adopt(ctx: HookContext) -> None:
    _CURRENT[:] = [ctx]
