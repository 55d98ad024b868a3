"""Deferred capture's hooks in vLLM's real MRV2 classes on CPU: every intermediate state.

Run in the oracle venv: PYTHONPATH=SRC/<version>:REPO/src:REPO python deferred_runtime_check.py OUT.json

vLLM's capture itself needs a GPU, so `ModelCudaGraphManager.capture` is replaced by a
recorder before capplan hooks it (as are the step, the async output and the idle loop's
bodies); everything capplan installs around them, and vLLM's real manager, candidate
table and descriptors, run as in the engine. After the start-up capture and after every
deferred capture (one per idle turn of the real hooked `_process_input_queue`), every
batch of a dense grid is dispatched through the hooked manager: the graph it replays must
be captured, compatible with the batch, and its LoRA kernel grid must cover the batch.
"""

from __future__ import annotations

import functools
import inspect
import json
import queue
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))

import vllm  # noqa: E402
import vllm.v1.worker.gpu.async_utils as async_utils  # noqa: E402
import vllm.v1.worker.gpu.cudagraph_utils as cg  # noqa: E402
import vllm.v1.worker.gpu.model_runner as runner_mod  # noqa: E402
from runtime_check import model_manager  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import compile_plan  # noqa: E402
from capplan.planner.dispatch import Batch, Dispatcher, compatible  # noqa: E402
from capplan.planner.lora_cases import kernel_slots  # noqa: E402
from capplan.planner.tiers import attention_warm  # noqa: E402
from capplan.runtime import registry  # noqa: E402
from capplan.runtime.deferred.estimate import SAMPLES_MAX, SAMPLES_MIN, spread_sample  # noqa: E402
from capplan.runtime.deferred.pauses import Pauses  # noqa: E402
from capplan.runtime.versions import detect_release  # noqa: E402

RELEASE = detect_release(vllm.__version__)
SPEC = {
    "target": {"vllm": RELEASE.version},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "tiers": {"ready": ["FULL:1x1@0", "PIECEWISE:8@1"], "every_steps": 2},
}

ATTN_THRESHOLD = 8
# vLLM's attn_groups as the capture gets them: one group, a builder with TRITON_ATTN's threshold.
ATTN_GROUPS = [[SimpleNamespace(metadata_builders=[SimpleNamespace(seq_threshold_3D=ATTN_THRESHOLD)])]]
captures: list[list] = []  # the descriptors each capture call saw
DISPATCHER: Dispatcher
seen_lock_held: list[bool] = []


VLLM_CAPTURE = cg.ModelCudaGraphManager.capture


@functools.wraps(VLLM_CAPTURE)  # vLLM's signature, which capplan checks and binds by name
def fake_capture(*args, **kwargs):
    """Records what vLLM's capture would capture, and warms each graph's LoRA state through
    the hook it is given, as vLLM's create_forward_fn does."""
    arguments = inspect.signature(VLLM_CAPTURE).bind(*args, **kwargs).arguments
    self = arguments["self"]
    descs = [d for descs in self._capture_descs.values() for d in descs]
    captures.append(descs)
    hook = arguments.get("lora_capture_hook")
    for d in descs:
        if hook is not None:
            hook(d.num_active_loras, d.num_reqs or min(d.num_tokens, 16), d.num_tokens)
    self._graphs_captured = True
    return {}


class FakeAdapterManager:
    """vLLM's LoRA model manager as the deferred LoRA hook uses it: the slot table and the
    punica mapping call, recorded."""

    def __init__(self) -> None:
        self.lora_index_to_id = [7, None, 9, None]  # live adapters in two of four slots
        self._last_mapping = "the last step's mapping"
        self.calls: list[tuple] = []

    def _set_adapter_mapping(self, mapping) -> None:
        self.calls.append((list(self.lora_index_to_id), mapping.index_mapping, mapping.prompt_mapping))


def fake_step(self, scheduler_output, intermediate_tensors=None, dummy_run=False, skip_attn_for_dummy_run=False):
    return "stepped"


def fake_profile(self):
    return 1000  # vLLM's CUDA-graph memory estimate, in bytes


def fake_get_output(self):
    seen_lock_held.append(registry.installed().deferred.lock.locked())
    return "output"


class WouldBlock(Exception):
    """vLLM's loop waited for input: what it does when no capture is pending, or while asleep."""


class Inputs(queue.Queue):
    def get(self, block=True, timeout=None):
        if block and self.empty():
            raise WouldBlock
        return super().get(block, timeout)


def address_of(plan, desc) -> int:
    for g in plan.graphs:
        d = g.descriptor
        if (d.cg_mode, d.num_tokens, d.num_reqs, d.uniform_token_count, d.num_active_loras) == (
            desc.cg_mode.name,
            desc.num_tokens,
            desc.num_reqs,
            desc.uniform_token_count,
            desc.num_active_loras,
        ):
            return g.id
    return -1


def check_state(plan, manager, captured: set[int]) -> tuple[int, list[str]]:
    """Dispatch a dense grid through the hooked manager; the problems found."""
    problems: list[str] = []
    checked = 0
    for r in range(1, 17):
        for t in range(r, 130, 3 if t_step_big(r) else 1):
            q = -(-t // r)
            u = q if t == q * r else None
            for k in range(0, min(r, 4) + 1):
                for base in (False, True):
                    if base and k == r:
                        continue
                    slots = kernel_slots(k, base)
                    desc = manager.dispatch(r, t, u, slots)
                    checked += 1
                    if desc.cg_mode.name == "NONE":
                        if DISPATCHER.dispatch(Batch(r, t, q, k, base)).graph_id >= 0:
                            problems.append(f"batch {r}x{t} k={k} base={base}: eager, though the plan has its graph")
                        continue
                    gid = address_of(plan, desc)
                    g = plan.graphs[gid] if gid >= 0 else None
                    if g is None or gid not in captured:
                        problems.append(f"batch {r}x{t} k={k} base={base}: replays an uncaptured graph {desc}")
                    elif not compatible(g.descriptor, r, u, None) or g.descriptor.num_tokens < t:
                        problems.append(f"batch {r}x{t} k={k} base={base}: {desc} cannot replay it")
                    elif g.dummy.kernel_grid is not None and g.dummy.kernel_grid < slots:
                        problems.append(f"batch {r}x{t} k={k} base={base}: grid {g.dummy.kernel_grid} < {slots}")
    return checked, problems


def t_step_big(r: int) -> bool:
    return r > 4


def main(out: Path) -> None:
    global DISPATCHER
    spec = spec_from_data(SPEC, "deferred")
    plan = compile_plan(spec)
    DISPATCHER = Dispatcher(plan)
    assert plan.tiers is not None
    # TRITON_ATTN's builders carry seq_threshold_3D: the deferred graphs that would be the first
    # of an attention kernel are made ready at the first capture; the rest stay deferred.
    plan_ready = set(range(len(plan.graphs))) - set(plan.tiers.deferred)
    warm = attention_warm(plan.graphs, plan_ready, SPEC["scheduler"]["max_num_seqs"], [ATTN_THRESHOLD])
    DEFERRED = [g for g in plan.tiers.deferred if g not in warm]
    report: dict = {
        "vllm": vllm.__version__,
        "graphs": len(plan.graphs),
        "deferred": len(DEFERRED),
        "warmed": len(warm),
    }
    cg.ModelCudaGraphManager.capture = fake_capture
    runner_mod.GPUModelRunner.execute_model = fake_step
    async_utils.AsyncOutput.get_output = fake_get_output
    if RELEASE.profiling_capture:
        runner_mod.GPUModelRunner.profile_cudagraph_memory = fake_profile
    state = registry.install(plan, "deferred.plan.yaml")
    deferred = state.deferred
    manager = model_manager(spec.model_dump(mode="json"))
    # Start-up: vLLM's capture_model calls capture once; only the ready graphs are captured.
    import torch

    tables = SimpleNamespace(input_block_tables=[torch.full((16, 8), 5, dtype=torch.int32)])
    adapters = FakeAdapterManager()
    deferred.runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=adapters))
    ready = sorted(set(range(len(plan.graphs))) - set(DEFERRED))
    mode = {g.id: g.descriptor.cg_mode for g in plan.graphs}
    if RELEASE.profiling_capture:
        # vLLM's memory profiling (0.29.0 on) captures on a manager of its own first, one graph per
        # call (each one measured), in vLLM's order: the ready PIECEWISE graphs, an evenly spaced
        # sample of the deferred ones (in plan order), vLLM's own sample of the FULL graphs (its
        # largest two), an evenly spaced sample of the other deferred FULL ones. Every capture reads 0 bytes here (no GPU), so each
        # sample is SAMPLES_MIN graphs, or all of them where there are fewer.
        profiling = model_manager(spec.model_dump(mode="json"))
        profiling._capture_mem_samples = []
        profiling._max_full_descs_to_capture = 2
        profiling.capture("model", "model_state", "buffers", None, tables, ATTN_GROUPS, "kv", has_lora=True,
                          lora_capture_hook=lambda *a: None)  # fmt: skip
        ready_pw = [g for g in ready if mode[g] == "PIECEWISE"]
        all_full = [g for g in range(len(plan.graphs)) if mode[g] == "FULL"]
        deferred_pw = [g for g in DEFERRED if mode[g] == "PIECEWISE"]
        deferred_full = [g for g in DEFERRED if mode[g] == "FULL" and g not in all_full[:2]]
        sampled_pw = spread_sample(deferred_pw, SAMPLES_MIN)
        expected = [*ready_pw, *sampled_pw, *all_full[:2], *spread_sample(deferred_full, SAMPLES_MIN)]
        report["profiling_samples_deferred_graphs"] = bool(sampled_pw) and set(sampled_pw) <= set(DEFERRED)
        report["profiling_calls_as_planned"] = [[address_of(plan, d) for d in c] for c in captures] == [
            [g] for g in expected
        ]
        left = {m.name: [address_of(plan, d) for d in ds] for m, ds in profiling._capture_descs.items()}
        report["profiling_left_captured_pw_and_all_full"] = left == {
            "PIECEWISE": sorted(ready_pw + sampled_pw),
            "FULL": all_full,
        }
        report["profiling_did_not_start_deferral"] = not deferred.active and len(deferred.pending) == len(DEFERRED)
        deferred.state.start.profiling_extra = 7 * 2**20
        report["profiled_estimate_plus_extra"] = runner_mod.GPUModelRunner.profile_cudagraph_memory(None) == (
            1000 + 7 * 2**20
        )
        captures.clear()
    startup_hook_calls: list = []
    manager.capture(
        "model", "model_state", "buffers", None, tables, ATTN_GROUPS, "kv", has_lora=True,
        lora_capture_hook=lambda *a: startup_hook_calls.append(a),
    )  # fmt: skip
    # Each ready graph in a call of its own (its memory measured), in plan order; before 0.29.0
    # (no profiling pass), then an evenly spaced sample of each mode's deferred graphs, which stay
    # captured: every capture reads 0 bytes here, so SAMPLES_MIN of a mode, at most half of them.
    # After the profiling pass, the deferred graphs in plan order while each takes no memory:
    # every one here, so SAMPLES_MAX of them, at most half.
    sampled: list[int] = []
    if not RELEASE.profiling_capture:
        for m in ("PIECEWISE", "FULL"):
            of_mode = [g for g in DEFERRED if mode[g] == m]
            sampled += spread_sample(of_mode, min(SAMPLES_MIN, len(of_mode) // 2))
    free = DEFERRED[: min(SAMPLES_MAX, len(DEFERRED) // 2)] if RELEASE.profiling_capture else []
    report["sampled_at_start"] = len(sampled)
    report["free_at_start"] = len(free)
    report["startup_sampled_as_planned"] = (
        deferred.state.start.sampled_ids == sampled and deferred.state.start.free_ids == free
    )
    report["startup_captured_ready_in_plan_order"] = [address_of(plan, d) for c in captures for d in c] == [
        *ready,
        *sampled,
        *free,
    ] and all(len(c) == 1 for c in captures)
    DEFERRED = [g for g in DEFERRED if g not in sampled and g not in free]
    report["deferred"] = len(DEFERRED)  # captured while serving
    ready = sorted(set(range(len(plan.graphs))) - set(DEFERRED))
    report["capture_list_restored"] = sum(len(v) for v in manager._capture_descs.values()) == len(ready)
    report["startup_used_vllm_hook"] = len(startup_hook_calls) == len(ready) and adapters.calls == []
    startup_calls = len(captures)
    states, problems, checked = 0, [], 0
    n, p = check_state(plan, manager, set(ready))
    states, checked, problems = 1, n, p
    # Steps: no capture while a step's sampling is pending; one before every 2nd step otherwise.
    runner = SimpleNamespace(
        execute_model_state="pending",
        lora_config=None,
        lora_manager=deferred.runner.lora_manager,  # the same runner that captured at start-up
        dp_rank=0,
        dp_size=1,
        decode_query_len=1,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    before = len(captures)
    for _ in range(4):
        runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
    report["captures_while_sampling_pending"] = len(captures) - before
    runner.execute_model_state = None
    for _ in range(4):
        result = runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
        n, p = check_state(plan, manager, deferred.state.graphs.captured)
        states, checked, problems = states + 1, checked + n, problems + p
    report["step_result_passed_through"] = result == "stepped"
    report["captures_in_4_steps_every_2"] = len(captures) - before
    report["one_graph_per_capture"] = all(len(c) == 1 for c in captures[startup_calls:])
    # A capture expected to pause a step longer than the budget (one of the latest captures of
    # its mode took longer) is not taken before a step: it is left to the idle turns.
    measured = {mode: list(times) for mode, times in deferred.state.serving.recent_seconds.items()}
    report["capture_times_measured"] = set(measured) >= {"PIECEWISE", "any"}
    for times in deferred.state.serving.recent_seconds.values():
        times.append(1.0)  # one slow capture among the latest
    deferred.state.graphs.misses.clear()  # no batch has missed a pending graph (check_state's dispatches did)
    before = len(captures)
    for _ in range(4):
        runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
    report["slow_captures_left_to_idle"] = len(captures) == before and deferred.state.serving.left_to_idle == 2
    # Under sustained load there is no idle turn: a slow capture of a graph the traffic missed runs
    # on a step turn anyway, the most missed first, at most once every slow-capture spacing's steps.
    pending = deferred.state.graphs.pending
    wanted = pending[-1]  # the last of the queue, as the graphs the 8B load needed were
    deferred.state.graphs.misses.clear()
    for _ in range(3):
        deferred.state.graphs.resolve(wanted)  # a batch dispatched to it replays its fallback
    before, steps0 = len(captures), deferred.state.serving.steps
    spacing = deferred.state.pauses.slow_every_steps
    report["default_pauses"] = (deferred.state.pauses.step_pause_s, spacing) == (0.05, 100)
    while deferred.state.serving.steps - steps0 < 2 * spacing:
        runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
        for times in deferred.state.serving.recent_seconds.values():
            times.append(1.0)  # every capture slow, as at 8B (about 105 ms against the 50 ms budget)
    paced = [address_of(plan, d) for c in captures[before:] for d in c]
    report["missed_graph_landed_first_under_load"] = paced[:1] == [wanted]
    report["slow_step_captures_spaced"] = len(paced) == 1  # the others were never missed: left to idle
    report["miss_counted"] = deferred.state.graphs.misses[wanted] == 3
    # The operator's bounds: spacing 0, a slow capture never pauses a step, missed or not; a bound
    # above the captures' time, a step turn captures as a fast one would.
    second = next(g for g in deferred.state.graphs.pending if g != wanted)

    def steps_under_load(n: int) -> list[str]:
        start = len(captures)
        for _ in range(n):
            runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
            for times in deferred.state.serving.recent_seconds.values():
                times.append(1.0)
        return [address_of(plan, d) for c in captures[start:] for d in c]

    deferred.state.graphs.resolve(second)
    deferred.state.pauses = Pauses(step_pause_s=0.05, slow_every_steps=0)
    report["operator_spacing_0_never_pauses"] = steps_under_load(2 * spacing) == []
    deferred.state.pauses = Pauses(step_pause_s=2.0, slow_every_steps=100)
    landed = steps_under_load(deferred.state.tiers.every_steps)
    report["operator_bound_above_captures_lands"] = landed[:1] == [second]
    # Many graphs missed at once, every capture slow: the first SLOW_BURST land on consecutive step
    # turns, then one per spacing's steps (a token bucket: no more paused steps, sooner landings).
    burst = 2  # a burst below the graphs pending here (the default is SLOW_BURST); the later checks need some left
    deferred.state.pauses = Pauses(slow_burst=burst)
    missed = list(deferred.state.graphs.pending)[: burst + 2]
    report["burst_graphs_missed"] = len(missed)
    for gid in missed:
        deferred.state.graphs.resolve(gid)
    landed_at: list[int] = []  # steps from here to each landing
    landed0 = len(deferred.state.serving.landed)
    every, steps0 = deferred.state.tiers.every_steps, deferred.state.serving.steps
    for _ in range(2 * spacing + 2 * burst * every):
        if steps_under_load(1):
            landed_at.append(deferred.state.serving.steps - steps0)
            n, p = check_state(plan, manager, deferred.state.graphs.captured)  # every batch replays a fit
            states, checked, problems = states + 1, checked + n, problems + p
    report["burst_lands_at_once"] = landed_at[:burst] == [landed_at[0] + every * i for i in range(burst)]
    report["burst_all_landed"] = sorted(deferred.state.serving.landed[landed0:]) == sorted(missed)
    # never more paused steps than the burst and one a spacing's steps: the 1% on average
    report["burst_paced_after"] = all(i + 1 <= burst + at / spacing for i, at in enumerate(landed_at)) and all(
        b - a >= spacing - every for a, b in zip(landed_at[burst:], landed_at[burst + 1 :])
    )
    deferred.state.pauses = Pauses()
    n, p = check_state(plan, manager, deferred.state.graphs.captured)  # the graph landed there: replays a fit
    states, checked, problems = states + 1, checked + n, problems + p
    n, p = check_state(plan, manager, deferred.state.graphs.captured)  # every batch still replays a fit
    states, checked, problems = states + 1, checked + n, problems + p
    for mode, times in deferred.state.serving.recent_seconds.items():
        times.clear()
        times.extend(measured[mode])
    # With more than one TP or PP rank no step captures (their time is rank-local): idle turns only.
    deferred.state.serving.step_captures = False
    before, steps = len(captures), deferred.state.serving.steps
    for _ in range(4):
        runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
    report["multi_rank_steps_never_capture"] = len(captures) == before and deferred.state.serving.steps == steps + 4
    deferred.state.serving.step_captures = True
    # The async output thread takes the capture lock.
    async_utils.AsyncOutput.get_output(SimpleNamespace())
    report["output_takes_capture_lock"] = seen_lock_held == [True]
    # Idle: the real hooked loop asks every worker (here: this process) for one graph per turn.
    calls: list[int] = []

    def collective_rpc(fn):
        result = fn(None)
        calls.append(result)
        n, p = check_state(plan, manager, deferred.state.graphs.captured)
        nonlocal states, checked, problems
        states, checked, problems = states + 1, checked + n, problems + p
        return [result]

    handled: list = []
    inputs = Inputs()
    inputs.put(("UTILITY", "add_lora"))  # a request that brings no work: vLLM's loop handles it
    aborts: queue.Queue = queue.Queue()
    aborts.put(["a stale abort"])
    sleeping = [True]
    core = SimpleNamespace(
        has_work=lambda: False,
        input_queue=inputs,
        aborts_queue=aborts,
        is_sleeping=lambda: sleeping[0],
        is_running=lambda: True,
        collective_rpc=collective_rpc,
        _handle_client_request=lambda kind, request: handled.append((kind, request)),
        _notify_idle_state_callbacks=lambda: None,
        process_input_queue_block=True,
    )

    def turn() -> str:
        """One turn of vLLM's busy loop: the hooked (real) _process_input_queue."""
        try:
            EngineCoreProc._process_input_queue(core)
            return "returned"
        except WouldBlock:
            return "blocked"

    # Asleep: no capture; vLLM's loop handles the request, then waits for input as usual.
    report["asleep_blocks_as_vllm"] = turn() == "blocked" and core.process_input_queue_block is True
    # (landed before: 2 on step turns, 1 paced for the missed graph, 1 under the operator's raised
    # bound, and the burst's missed graphs)
    report["asleep_no_capture"] = calls == [] and len(deferred.pending) == len(DEFERRED) - 4 - len(missed)
    report["idle_loop_handled_utility_request"] = handled == [("UTILITY", "add_lora")]
    sleeping[0] = False
    turns = []
    while deferred.pending and len(turns) < 1000:
        if len(turns) == 2:
            inputs.put(("UTILITY", "list_loras"))  # input first: handled by vLLM's pass, no capture that turn
            before_rpc = len(calls)
            turns.append(turn())
            report["input_turn_no_capture"] = len(calls) == before_rpc
            continue
        turns.append(turn())
    # Every turn returns while graphs are pending; the turn that captures the last one goes on
    # into vLLM's own blocking wait for input.
    report["idle_turns_never_block"] = set(turns[:-1]) == {"returned"} and turns[-1] == "blocked"
    report["idle_loop_handled_utility_request"] &= handled[-1] == ("UTILITY", "list_loras")
    report["aborts_queue_drained_as_vllm"] = aborts.empty()
    report["idle_rpc_calls"] = len(calls)
    # Nothing pending: vLLM's own blocking wait is back, its setting restored.
    report["idle_loop_returns_original"] = turn() == "blocked" and core.process_input_queue_block is True
    report["pending_after_idle"] = len(deferred.pending)
    report["final_set_is_the_plan"] = deferred.state.graphs.captured == set(range(len(plan.graphs)))
    captured_order = [address_of(plan, c[0]) for c in captures[startup_calls:]]
    # each deferred graph once; the order follows the misses of check_state's dispatches (most first)
    report["deferred_captured_each_once"] = sorted(captured_order) == sorted(DEFERRED)
    # Deferred LoRA graphs: the mapping went to the punica wrapper with slot i read as adapter
    # i + 1; the live slot table came back, and the next step recomputes its mapping.
    lora_graphs = [g for g in DEFERRED if plan.graphs[g].descriptor.num_active_loras > 0]
    report["deferred_lora_mappings"] = len(adapters.calls) == len(DEFERRED)
    report["slots_during_capture"] = sorted({tuple(c[0]) for c in adapters.calls})
    report["live_slots_restored"] = adapters.lora_index_to_id == [7, None, 9, None]
    report["last_mapping_forgotten"] = adapters._last_mapping is None
    case4 = next(g for g in lora_graphs if plan.graphs[g].descriptor.num_active_loras == 4)
    call = adapters.calls[captured_order.index(case4)]
    report["case4_prompt_ids"] = sorted({int(i) for i in call[2]})
    report["block_tables_zeroed"] = int(tables.input_block_tables[0].abs().sum()) == 0
    # Busy engine: the loop leaves at once.
    core.has_work = lambda: True
    before_rpc = len(calls)
    report["busy_loop_calls_no_rpc"] = turn() == "returned" and len(calls) == before_rpc
    report["states_checked"] = states
    report["batches_checked"] = checked
    report["problems"] = problems[:10]
    report["fallback_steps_counted"] = deferred.state.graphs.fallback_steps
    report["report_json"] = state.report.to_json()["deferred"]
    out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
