"""One DP rank's batches for the CPU DP checks (dp_sync_worker.py, dp_deferred_worker.py): random
steps of real batches and idle ranks, with the LoRA count vLLM's runner gives each."""

from __future__ import annotations

import random
from types import SimpleNamespace

import runtime_check  # noqa: F401  (puts the oracle on the path, imports vLLM)
import torch.distributed as dist
import vllm.distributed.parallel_state as ps
import vllm.v1.worker.gpu.dp_utils as dp_utils
import vllm.v1.worker.gpu.model_runner as runner_mod

MAX_LORAS = 4


def stand_in_dp_group(rank: int) -> None:
    """vLLM's DP group and world group (the ranks are DP ranks of TP 1), stood in for by the gloo
    world group (everything else is vLLM's code)."""
    group = SimpleNamespace(
        cpu_group=dist.group.WORLD,
        rank_in_group=rank,
        world_size=dist.get_world_size(),
        cpu_all_reduce_=lambda t: dist.all_reduce(t, group=dist.group.WORLD),
    )
    ps.get_dp_group = lambda: group
    ps.get_world_group = lambda: group
    dp_utils.get_dp_group = lambda: group
    if hasattr(dp_utils, "should_skip_dp_coordination"):  # 0.33
        dp_utils.should_skip_dp_coordination = lambda: False


def lora_count(adapters: int, base: bool, dummy: bool) -> int:
    """vLLM's (or, under lora_slot, the plan's) count for a batch, via the runner's function."""
    names = [f"a{i}" for i in range(adapters)] + (["base"] if base else [])
    state = SimpleNamespace(
        lora_requests={f"a{i}": i + 1 for i in range(adapters)},
        get_activate_loras=lambda ids: {x for x in ids if x.startswith("a")},
    )
    return runner_mod.get_num_active_loras_for_dispatch(SimpleNamespace(max_loras=MAX_LORAS), state, names, dummy)


def batch(rng: random.Random, busy: bool = False) -> tuple[int, int, int | None, int, int, dict | None]:
    """(num_reqs, num_tokens, uniform, max_query_len, lora count, trace line or None when idle)
    for one step of this rank (`busy`: never idle)."""
    kind = rng.random()
    if busy:
        kind = 0.15 + 0.85 * kind
    if kind < 0.15:  # idle rank: vLLM runs a one-token dummy batch
        return 1, 1, 1, 1, lora_count(0, False, True), None
    reqs = rng.randint(1, 16)
    adapters = rng.randint(0, min(reqs, MAX_LORAS))
    base = adapters < reqs and rng.random() < 0.6
    line: dict = {"num_reqs": reqs, "num_active_loras": adapters, "base": base and adapters > 0}
    if kind < 0.75:  # uniform decode
        return reqs, reqs, 1, 1, lora_count(adapters, base, False), {**line, "num_tokens": reqs, "max_query_len": 1}
    tokens = rng.randint(reqs, 256 if kind > 0.95 else 48)  # sometimes past the largest graph, within the budget
    q = -(-tokens // reqs)
    line |= {"num_tokens": tokens, "max_query_len": q}
    return reqs, tokens, (q if q * reqs == tokens else None), q, lora_count(adapters, base, False), line
