"""One process of the tensor-parallel deferred-capture check: an engine core and its TP workers,
on CPU, over gloo.

    PYTHONPATH=SRC/<version>:REPO/src:REPO python tp_deferred_worker.py RANK WORLD PORT MODE OUT.json

Rank 0 is the engine core: it runs vLLM's real `EngineCoreProc._process_input_queue` with
capplan's idle hook installed, and its `collective_rpc` broadcasts the call to every worker and
gathers their answers, as vLLM's multiprocessing executor does (one ordered broadcast for steps
and calls alike). Ranks 1..WORLD-1 are the TP workers: each installs the plan into vLLM's real
`ModelCudaGraphManager`, and runs every step the core broadcasts through the hooked
`GPUModelRunner.execute_model` (its body stood in for, as in deferred_runtime_check.py).

vLLM's capture needs a GPU, so it is stood in for by what makes a TP capture a collective: each
graph's capture all-reduces its address over the workers' group (a TP forward all-reduces, and
vLLM's `graph_capture` registers the custom all-reduce's graph buffers across the group as it
exits). After every step each
worker dispatches a grid of batches through the hooked manager and all-reduces a digest of what
it would replay: the ranks must agree on both, at every step.

MODE:
- lockstep:   capplan as it runs (more than one TP rank: no step captures, idle turns only).
- pipeline:   the same with the workers as pipeline stages (TP 1 each): stage 1 sends the padded
              batch's activations to stage 2, so the stages must replay alike too. Only the first
              stage's layers are attention layers (its capture gets TRITON_ATTN's builder, the
              second none): the stages must make the same graphs ready for the attention kernels.
- rank_local: the control: step captures left on, each rank's step-pause rule reading its own
              capture times, which differ a little between ranks (rank 1's latest captures here
              read 10 ms, the others' 60 ms). The ranks must be seen to diverge (or hang, which
              the timeout ends).
- rank_local_free: the control of the start-up capture after vLLM's profiling pass (0.29.0 on):
              each rank deciding on its own memory readings which deferred graphs it captures
              before the engine is ready, not on every rank's at once (`agreed`).

Memory readings differ between ranks, as on GPUs: each rank reads a granule for one of the
first deferred graphs (rank 1 the 2nd, rank 2 the 4th) and nothing for the others. Where vLLM
profiles (0.29.0 on) the workers run its profiling capture first, on a manager of their own, as
deferred_runtime_check.py does; capplan's votes run over the workers' group, which stands in
for vLLM's TP and PP groups.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import queue
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

rank, world, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The world group (the core's broadcasts) waits out slow starts: each process imports vLLM, tens of
# seconds on a loaded machine. The workers' group ends the control's hang (it diverges, then waits).
START = datetime.timedelta(seconds=240)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=START)
CONTROL = mode.startswith("rank_local")
TP = dist.new_group(list(range(1, world)), timeout=datetime.timedelta(seconds=15) if CONTROL else START)

import deferred_runtime_check as drc  # noqa: E402  (vLLM's classes, the stand-ins' shapes)
import vllm.v1.worker.gpu.model_runner as runner_mod  # noqa: E402
from collectives import Lockstep, stand_in_gpu  # noqa: E402
from runtime_check import model_manager  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from capplan.planner.lora_cases import kernel_slots  # noqa: E402
from capplan.runtime import registry  # noqa: E402
from capplan.runtime.deferred.ranks import RankGroups  # noqa: E402

TP_SIZE = world - 1
# The plan leaves tensor_parallel_size unpinned (it changes no graph), so the oracle's TP-1 config passes
# capplan's engine check; the manager is then given the TP size, which is all deferred capture reads.
SPEC = {**drc.SPEC, "tiers": {"ready": ["FULL:1x1@0"], "every_steps": 1}}
report: dict = {"rank": rank, "mode": mode, "vllm": drc.vllm.__version__}
LOCKSTEP = Lockstep(TP)
agree = LOCKSTEP.agree


def digest(manager) -> int:
    """What this rank would replay for a grid of batches, as one number."""
    seen = []
    for r in (1, 2, 3, 5, 8, 13, 16):
        for t in sorted({r, 2 * r, 3 * r + 1, 7 * r, 31, 100, 250, 512}):
            if t < r or t > 512:
                continue
            q = -(-t // r)
            for k in range(0, min(r, 4) + 1):
                desc = manager.dispatch(r, t, q if t == q * r else None, kernel_slots(k, k < r))
                seen.append((desc.cg_mode.name, desc.num_tokens, desc.num_reqs, desc.num_active_loras))
    return int.from_bytes(hashlib.sha256(repr(seen).encode()).digest()[:7], "big")


def broadcast(event):
    box = [event]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# vLLM's world group (what the plan check exchanges over) is the workers', as with vLLM's executor.
parallel_state.get_world_group = lambda: SimpleNamespace(cpu_group=TP, rank_in_group=rank - 1, world_size=TP_SIZE)
SPEC_OBJ, PLAN = stand_in_gpu(LOCKSTEP, drc.fake_step, SPEC, "tp-deferred")
state = registry.install(PLAN, "tp-deferred.plan.yaml")


def engine_core() -> None:
    """The schedule: steps, then idle turns of vLLM's hooked loop, and so on until all landed."""
    turns: list[str] = []
    pending_seen: list[int] = []
    inputs = drc.Inputs()

    def collective_rpc(fn):
        broadcast(("rpc", fn))
        answers = [None] * world
        dist.gather_object(None, answers, dst=0)
        pending_seen.append(max(answers[1:]))
        return answers[1:]

    core = SimpleNamespace(
        has_work=lambda: False,
        input_queue=inputs,
        aborts_queue=queue.Queue(),
        is_sleeping=lambda: False,
        is_running=lambda: True,
        collective_rpc=collective_rpc,
        _handle_client_request=lambda kind, request: None,
        _notify_idle_state_callbacks=lambda: None,
        process_input_queue_block=True,
    )
    steps = 0
    for _ in range(200):
        for _ in range(5):
            broadcast(("step", steps))
            steps += 1
        for _ in range(3):
            try:
                EngineCoreProc._process_input_queue(core)
                turns.append("returned")
            except drc.WouldBlock:
                turns.append("blocked")
        if pending_seen and pending_seen[-1] == 0:
            break
    for _ in range(5):
        broadcast(("step", steps))
        steps += 1
    broadcast(("stop", None))
    report.update(steps=steps, idle_rpcs=len(pending_seen), pending_seen=pending_seen, turns=turns)


def rank_manager():
    """vLLM's manager as this rank's: its pipeline stage, or the TP size."""
    manager = model_manager(SPEC_OBJ.model_dump(mode="json"))
    if mode == "pipeline":  # vLLM's manager reads the stage from get_pp_group(); the oracle builds one stage
        manager.is_first_pp_rank, manager.is_last_pp_rank = rank == 1, rank == world - 1
    else:  # vLLM's manager reads tensor_parallel_size into tp_size; the oracle builds TP 1
        manager.tp_size = TP_SIZE
    return manager


def read_by_rank(deferred):
    """Each capture's memory as this rank reads it: a granule for one of the first deferred graphs
    not made ready for the attention kernels (the 2nd on rank 1, the 4th on rank 2), nothing for
    the others."""
    capture_one = deferred.state.capture_one

    def measured(gid, call, manager, capture_fn):
        got = capture_one(gid, call, manager, capture_fn)
        reads = [g for g in PLAN.tiers.deferred if g not in deferred.state.start.warmed][2 * rank - 1]
        return replace(got, used=2 * 2**20 if gid == reads else 0)

    return measured


class OwnReadings(RankGroups):
    """The control: each rank decides on its own readings (what it reads is still joined)."""

    def agreed(self, yes):
        return yes


def worker() -> None:
    deferred = state.deferred
    groups = lambda: [TP]  # noqa: E731 - vLLM's TP and PP groups, stood in for by the workers'
    deferred.state.ranks = OwnReadings(groups) if mode == "rank_local_free" else RankGroups(groups)
    deferred.state.capture_one = read_by_rank(deferred)
    manager = rank_manager()
    adapters = drc.FakeAdapterManager()
    deferred.runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=adapters))
    if mode == "rank_local":
        deferred.ready_only = _keep_step_captures(deferred.ready_only, deferred)
    tables = SimpleNamespace(input_block_tables=[torch.zeros((16, 8), dtype=torch.int32)])
    attn_groups = drc.ATTN_GROUPS if mode == "pipeline" and rank == 1 else []  # the stage's attention layers
    if drc.RELEASE.profiling_capture:  # vLLM's memory profiling: its own manager, discarded
        profiling = rank_manager()
        profiling._capture_mem_samples = []
        profiling._max_full_descs_to_capture = 2
        profiling.capture("model", "model_state", "buffers", None, tables, attn_groups, "kv", has_lora=True,
                          lora_capture_hook=lambda *a: None)  # fmt: skip
        report["profiling_order"] = list(LOCKSTEP.captured_order)
        LOCKSTEP.captured_order.clear()
    manager.capture("model", "model_state", "buffers", None, tables, attn_groups, "kv", has_lora=True,
                    lora_capture_hook=lambda *a: None)  # fmt: skip
    report["step_captures"] = deferred.state.serving.step_captures
    if mode == "rank_local":
        for times in deferred.state.serving.recent_seconds.values():
            times.append(0.01 if rank == 1 else 0.06)
    runner = SimpleNamespace(
        execute_model_state=None,
        lora_config=None,
        lora_manager=deferred.runner.lora_manager,
        parallel_config=SimpleNamespace(tensor_parallel_size=TP_SIZE, pipeline_parallel_size=1),
    )
    states = 0
    digests = [digest(manager)]
    agree(3, digests[0], "start-up dispatch")
    while True:
        kind, payload = broadcast(None)
        if kind == "stop":
            break
        if kind == "step":
            runner_mod.GPUModelRunner.execute_model(runner, SimpleNamespace(), None, False)
            digests.append(digest(manager))
            agree(2, digests[-1], f"dispatch after step {payload}")
        else:
            answer = payload(None)  # capplan's capture_when_idle, as vLLM's worker runs an RPC
            digests.append(digest(manager))
            agree(4, digests[-1], "dispatch after an idle capture")
            dist.gather_object(answer, None, dst=0)
        states += 1
    report.update(
        states=states,
        captured=sorted(deferred.state.graphs.captured),
        captured_order=LOCKSTEP.captured_order,
        final_set_is_the_plan=deferred.state.graphs.captured == set(range(len(PLAN.graphs))),
        # the start-up capture: the ready graphs, then (without a profiling pass) each mode's sample
        # of the deferred ones, or (after one) the first deferred graphs while none reads memory,
        # the same on every rank; the rest while serving, in plan order
        sampled_at_start=deferred.state.start.sampled_ids,
        profiled=deferred.state.start.profiled_ids,
        free_at_start=deferred.state.start.free_ids,
        free_at_start_bytes=deferred.state.start.free_bytes,
        attention_thresholds=deferred.state.start.attention_thresholds,
        warmed=deferred.state.start.warmed,
        deferred_in_plan_order=LOCKSTEP.captured_order[len(deferred.state.graphs.ready_ids) :]
        == [
            g
            for g in PLAN.tiers.deferred
            if g
            not in {*deferred.state.start.sampled_ids, *deferred.state.start.free_ids, *deferred.state.start.warmed}
        ],
        left_to_idle=deferred.state.serving.left_to_idle,
        dispatch_states=len(set(digests)),  # how many different dispatch tables the ranks went through
    )


def _keep_step_captures(original, deferred):
    def ready_only(manager):
        original(manager)
        deferred.state.serving.step_captures = True  # the control: each rank's own step-pause rule decides

    return ready_only


try:
    dist.barrier()  # every process has imported vLLM: what follows runs in step
    if rank == 0:
        engine_core()
    else:
        worker()
    report["error"] = None
except Exception as exc:  # the control's ranks diverge: a collective pairs wrongly or times out
    report["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
report["mismatches"] = LOCKSTEP.mismatches[:10]
report["mismatch_count"] = len(LOCKSTEP.mismatches)
out.write_text(json.dumps(report, indent=2, default=str))
# Leave without tearing the gloo groups down: when another rank has already gone, the teardown can
# abort in C++ ("terminate called without an active exception", seen once in CI on this worker)
# after the report was written. The report file and the exit code are what the test reads.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
