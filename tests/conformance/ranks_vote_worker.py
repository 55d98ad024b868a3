"""One rank of the vote check: vLLM's real TP and PP groups (gloo, on CPU) carry capplan's vote
(`DeferredCapture.agreed`), by which an engine of several ranks decides, on every rank's memory
readings at once, what it captures before it is ready.

    PYTHONPATH=SRC/<version>:REPO/src:REPO python ranks_vote_worker.py RANK WORLD TP PORT OUT.json

Each rank builds vLLM's world, TP and PP groups as a worker does (`init_distributed_environment`,
`initialize_model_parallel`), then votes: once with each rank alone saying no, once with every rank
saying yes. Then it takes the first deferred graphs at start (`_free_at_start`) with its own
readings: rank r reads memory first at its (3 + 2r)-th deferred graph, nothing before, so every rank
must stop at the 3rd, where rank 0 first reads memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

rank, world, tp, port = (int(a) for a in sys.argv[1:5])
out = Path(sys.argv[5])

sys.path.insert(0, str(Path(__file__).parent))

import deferred_runtime_check as drc  # noqa: E402  (the deferred checks' spec)
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import compile_plan  # noqa: E402
from capplan.releases import RELEASES  # noqa: E402
from capplan.runtime.deferred.capture import DeferredCapture  # noqa: E402
from capplan.runtime.deferred.ranks import RankGroups  # noqa: E402

SPEC = {**drc.SPEC, "tiers": {"ready": ["FULL:1x1@0"], "every_steps": 1}}
PLAN = compile_plan(spec_from_data(SPEC, "ranks-vote"))

with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=world // tp, backend="gloo"
    )

ranks = RankGroups()  # vLLM's TP and PP groups, as the manager of a rank of several has them
deferred = DeferredCapture(SimpleNamespace(plan=PLAN, release=RELEASES[drc.RELEASE.version]), ranks=ranks)
groups = ranks.groups()
no_from_each = [deferred.state.agreed(rank != k) for k in range(world)]
every_yes = deferred.state.agreed(True)
first_read = 3 + 2 * rank  # the deferred graph (counted from 1) at which this rank first reads memory
taken: list[int] = []


def capture(gid: int) -> int:
    taken.append(gid)
    return 2 * 2**20 if len(taken) >= first_read else 0


deferred.startup.free_at_start(capture)
out.write_text(
    json.dumps(
        {
            "rank": rank,
            "vllm": drc.vllm.__version__,
            "group_sizes": [g.size() for g in groups],
            "no_from_each": no_from_each,
            "every_yes": every_yes,
            "free_at_start": deferred.state.start.free_ids,
            "pending_left": len(deferred.pending),
        }
    )
)
# Leave without tearing the gloo groups down: when another rank has already gone, the teardown can
# abort in C++ after the report was written. The report file and the exit code are what the test reads.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
