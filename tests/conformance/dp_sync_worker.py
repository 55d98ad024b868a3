"""One rank of the two-process DP runtime check: vLLM's real DP sync on CPU (gloo).

    PYTHONPATH=SRC/<version>:REPO/src:REPO python dp_sync_worker.py RANK PORT MODE OUT.json

MODE:
- sync:     both ranks install the same plan into vLLM's real
            ModelCudaGraphManager, then run 3000 steps of vLLM's own
            `dispatch_cg_and_sync_dp` (the model runner's call) with different
            batches and LoRA mixes per rank, CAPPLAN_DP_AUDIT on. Writes every
            step's agreed descriptor, the rank's report, and the rank's trace as
            the recorder writes it (real steps only, each with the runtime's
            dp_step).
- mismatch: rank 1's engine has max_loras 8, so rank 1 refuses its plan;
            rank 0 must stop too instead of waiting.
- noplan:   rank 1 runs without a plan (the plugin's guard only).

vLLM's DP group is stood in for by the gloo world group; everything else is
vLLM's code.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

rank, port, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
os.environ["CAPPLAN_DP_AUDIT"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

import dp_batches  # noqa: E402
import runtime_check  # noqa: E402  (puts the oracle on the path, imports vLLM)
import vllm.v1.worker.gpu.model_runner as runner_mod  # noqa: E402
from rank_exit import run_then_leave  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import compile_plan  # noqa: E402
from capplan.runtime import registry  # noqa: E402
from capplan.runtime.engine_check import PlanMismatch  # noqa: E402

dp_batches.stand_in_dp_group(rank)

SPEC = {
    "target": {"vllm": runtime_check.RELEASE.version},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "parallel": {"data_parallel_size": 2, "moe": True},
}
MAX_LORAS = dp_batches.MAX_LORAS
batch = dp_batches.batch
# The runner passes max_query_len to DP sync from 0.28 (None with a prefill in the batch).
PASSES_MAX_QUERY_LEN = runtime_check.RELEASE.rules.max_query_len_in_descriptor


def main() -> None:
    spec = spec_from_data(SPEC, "dp")
    result: dict = {"rank": rank}
    try:
        if mode == "noplan" and rank == 1:
            registry.install_guard()
        else:
            registry.install(compile_plan(spec), "dp.plan.yaml")
        engine = SPEC if not (mode == "mismatch" and rank == 1) else {**SPEC, "lora": {**SPEC["lora"], "max_loras": 8}}
        manager = runtime_check.model_manager(spec_from_data(engine, "e").model_dump(mode="json"))
    except PlanMismatch as exc:
        result["refused"] = str(exc)
        out.write_text(json.dumps(result))
        return
    result["refused"] = None
    if mode != "sync":
        out.write_text(json.dumps(result))
        return
    rng = random.Random(1000 + rank)
    steps, trace = [], []
    for i in range(3000):
        reqs, tokens, uniform, max_q, loras, line = batch(rng, busy=i in (0, 2999))  # traces span every step
        kwargs = {"num_active_loras": loras}
        if PASSES_MAX_QUERY_LEN:
            kwargs["max_query_len"] = max_q
        desc, _ = runner_mod.dispatch_cg_and_sync_dp(manager, reqs, tokens, uniform, 2, rank, **kwargs)
        steps.append([desc.cg_mode.name, desc.num_tokens, loras])
        if line is not None:  # what the recorder writes after a real step
            trace.append({**line, "dp_step": registry.installed().step.dp_step})
    report = registry.installed().report.to_json()
    result.update(steps=steps, report=report, trace=trace, spec=SPEC)
    out.write_text(json.dumps(result))


run_then_leave(main)
