"""One rank of the two-process check of deferred capture under DP ranks that pad to one another
(an MoE model's): vLLM's real DP sync on CPU (gloo), over every intermediate state.

    PYTHONPATH=SRC/<version>:REPO/src:REPO python dp_deferred_worker.py RANK PORT MODE OUT.json

Both ranks install a tiered plan (data_parallel_size 2, moe) into vLLM's real
ModelCudaGraphManager and run steps through the hooked `GPUModelRunner.execute_model`, whose
body (stood in for: it needs a GPU) calls vLLM's own `dispatch_cg_and_sync_dp` with this rank's
batch and LoRA count, as the runner does; an idle rank's step is vLLM's dummy batch
(`dummy_run`). vLLM's capture is stood in for by what makes an MoE capture a collective across
DP ranks: it all-reduces the graph's address over the DP group (the expert all-to-all runs
inside it). At every step the ranks must agree on the replayed graph's size and mode, and each
must replay a captured graph.

MODE:
- lockstep: capplan as it runs (a group, every LoRA case of one size, at every every_steps-th
            DP-synced step, dummy steps counted).
- single:   the control: one graph per capture instead of a group, so some states hold one
            LoRA case of a size and not another. The ranks must be seen to disagree.

Where vLLM profiles memory (0.29.0 on) both ranks run its profiling capture first, on a manager
of their own, as deferred_runtime_check.py does, reading memory differently (rank 0 a granule for
each capture, rank 1 none): DP ranks that pad to one another must sample the same graphs
whatever they read, and take none at start for reading no memory (their ready set stays closed
over each size's LoRA cases).

vLLM's DP group is stood in for by the gloo world group; everything else is vLLM's code.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import random
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

rank, port, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=240)
)

import deferred_runtime_check as drc  # noqa: E402  (vLLM's classes, the stand-ins' shapes)
import dp_batches  # noqa: E402
import runtime_check  # noqa: E402
import vllm.v1.worker.gpu.model_runner as runner_mod  # noqa: E402
from collectives import Lockstep, stand_in_gpu  # noqa: E402

from capplan.runtime import registry  # noqa: E402

dp_batches.stand_in_dp_group(rank)

SPEC = {
    "target": {"vllm": runtime_check.RELEASE.version},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": dp_batches.MAX_LORAS, "specialize_active": True},
    "parallel": {"data_parallel_size": 2, "moe": True},
    "tiers": {"ready": ["FULL:1x1@0"], "every_steps": 40},  # a group every 40 steps: long intermediate states
}
PASSES_MAX_QUERY_LEN = runtime_check.RELEASE.rules.max_query_len_in_descriptor
VLLM_STEP = runner_mod.GPUModelRunner.execute_model
LOCKSTEP = Lockstep()  # the DP group: the gloo world
agree = LOCKSTEP.agree


@functools.wraps(VLLM_STEP)
def dp_step(self, scheduler_output, intermediate_tensors=None, dummy_run=False, *args, **kwargs):
    """The runner's DP part of a step: vLLM's own dispatch and DP sync for this rank's batch."""
    reqs, tokens, uniform, max_q, loras = scheduler_output.batch
    extra = {"num_active_loras": loras}
    if PASSES_MAX_QUERY_LEN:
        extra["max_query_len"] = max_q
    desc, _ = runner_mod.dispatch_cg_and_sync_dp(MANAGER, reqs, tokens, uniform, 2, rank, **extra)
    return desc


SPEC_OBJ, PLAN = stand_in_gpu(LOCKSTEP, dp_step, SPEC, "dp-deferred")
MANAGER = None


def main() -> dict:
    global MANAGER
    state = registry.install(PLAN, "dp-deferred.plan.yaml")
    deferred = state.deferred
    MANAGER = manager = runtime_check.model_manager(SPEC_OBJ.model_dump(mode="json"))
    if mode == "single":
        deferred.state.graphs.group_of = {g: [g] for g in deferred.pending}  # the control: one graph per capture
    adapters = drc.FakeAdapterManager()
    deferred.runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=adapters))
    tables = SimpleNamespace(input_block_tables=[torch.zeros((16, 8), dtype=torch.int32)])
    capture_one = deferred.state.capture_one

    def read_by_rank(gid, call, manager, capture_fn):
        return replace(capture_one(gid, call, manager, capture_fn), used=2 * 2**20 if rank == 0 else 0)

    deferred.state.capture_one = read_by_rank
    profiled: list[int] = []
    if drc.RELEASE.profiling_capture:  # vLLM's memory profiling: its own manager, discarded
        profiling = runtime_check.model_manager(SPEC_OBJ.model_dump(mode="json"))
        profiling._capture_mem_samples = []
        profiling._max_full_descs_to_capture = 2
        profiling.capture("model", "model_state", "buffers", None, tables, [], "kv", has_lora=True,
                          lora_capture_hook=lambda *a: None)  # fmt: skip
        profiled = list(LOCKSTEP.captured_order)
        LOCKSTEP.captured_order.clear()
    manager.capture("model", "model_state", "buffers", None, tables, [], "kv", has_lora=True,
                    lora_capture_hook=lambda *a: None)  # fmt: skip
    runner = SimpleNamespace(
        execute_model_state=None,
        lora_config=None,
        lora_manager=deferred.runner.lora_manager,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=2),
    )
    rng = random.Random(2000 + rank)
    steps, uncaptured, fallback_steps = [], [], 0
    for i in range(1500):
        reqs, tokens, uniform, max_q, loras, line = dp_batches.batch(rng)
        so = SimpleNamespace(batch=(reqs, tokens, uniform, max_q, loras))
        before = deferred.state.graphs.fallback_steps
        desc = runner_mod.GPUModelRunner.execute_model(runner, so, None, line is None)
        fallback_steps += deferred.state.graphs.fallback_steps > before
        name = desc.cg_mode.name
        if name != "NONE":
            gid = drc.address_of(PLAN, desc)
            if gid not in deferred.state.graphs.captured:
                uncaptured.append(f"step {i}: {desc} is not captured")
        agree(2, -1 if name == "NONE" else desc.num_tokens, f"step {i}: replayed size")
        agree(3, {"NONE": 0, "PIECEWISE": 1, "FULL": 2}[name], f"step {i}: replayed mode")
        steps.append([name, desc.num_tokens, loras, len(deferred.pending)])
    return {
        "steps": steps,
        "uncaptured": uncaptured[:10],
        "fallback_steps": fallback_steps,
        "captured_order": LOCKSTEP.captured_order,
        "ready": len(deferred.state.graphs.ready_ids),
        "deferred_in_plan_groups": sorted(LOCKSTEP.captured_order[len(deferred.state.graphs.ready_ids) :])
        == sorted(PLAN.tiers.deferred),
        "pending_after": len(deferred.pending),
        "profiling_captured": profiled,
        "profiled_samples": deferred.state.start.profiled_ids,
        "taken_at_start": deferred.state.start.sampled_ids + deferred.state.start.free_ids,
        "idle_capture_returns": deferred.capture_idle(),
        "report": state.report.to_json()["deferred"],
    }


# Leave without tearing the gloo group down (as dp_sync_worker.py): the result file and the exit
# code are what the test reads.
code = 0
result: dict = {"rank": rank, "mode": mode, "vllm": drc.vllm.__version__}
try:
    result.update(main())
    result["error"] = None
except Exception as exc:  # the control's ranks can also pair collectives wrongly and time out
    result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    traceback.print_exc()
result["mismatches"] = LOCKSTEP.mismatches[:10]
result["mismatch_count"] = len(LOCKSTEP.mismatches)
out.write_text(json.dumps(result, default=str))
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
