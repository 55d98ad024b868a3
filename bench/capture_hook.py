"""The LoRA capture hook's own cost per graph: capplan's against vLLM's, same run.

Both hooks run once per LoRA graph at capture and end in the runner's
`_set_active_loras` (the GPU-side metadata work, the same for both); this
times everything before it: vLLM's `create_lora_capture_hook` (through
`LoRAModelRunnerMixin.maybe_select_dummy_loras`) and capplan's plan-driven
hook, over every LoRA graph of a plan, with `_set_active_loras` a no-op.
Runs in the conformance oracle's venv (vLLM's Python code on CPU):

    PYTHONPATH=.cache/vllm-oracle/src/0.25.0:src:. .cache/vllm-oracle/venv/bin/python -m bench.capture_hook [PLAN]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import vllm
from vllm.config import LoRAConfig
from vllm.v1.worker.gpu.lora_utils import create_lora_capture_hook
from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

from capplan.planfile import load_plan
from capplan.runtime import registry
from capplan.runtime.context import layouts_of
from capplan.runtime.versions import detect_release

ROUNDS = 5


class Runner:
    """What both hooks touch on vLLM's model runner; `_set_active_loras` does nothing."""

    def __init__(self) -> None:
        self.lora_manager = SimpleNamespace()
        self.calls = 0

    def maybe_select_dummy_loras(self, lora_config, num_scheduled_tokens, *args, **kwargs):
        return LoRAModelRunnerMixin.maybe_select_dummy_loras(self, lora_config, num_scheduled_tokens, *args, **kwargs)

    def _set_active_loras(self, *args, **kwargs) -> None:
        self.calls += 1


def time_hook(hook, graphs) -> float:
    """Best of ROUNDS: microseconds per graph."""
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for case, reqs, tokens in graphs:
            hook(case, reqs, tokens)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / len(graphs)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else Path("examples/qwen3-8b-multilora.plan.yaml")
    plan = load_plan(path)
    lora = plan.spec.lora
    graphs = [
        (g.descriptor.num_active_loras, g.dummy.num_reqs, g.descriptor.num_tokens)
        for g in plan.graphs
        if g.descriptor.num_active_loras > 0
    ]
    config = LoRAConfig(max_loras=lora.max_loras, max_lora_rank=8, specialize_active_lora=lora.specialize_active)
    vllm_runner, ours_runner = Runner(), Runner()
    vllm_hook = create_lora_capture_hook(config, vllm_runner)
    # capplan's entry for this release, installed over vLLM's function with what it reads of the
    # hook context: the plan's dummy layouts (no deferred capture here)
    entry = next(h for h in registry.entries(detect_release(vllm.__version__)) if h.name == "lora.capture_hook")
    ctx = SimpleNamespace(plan_path=str(path), layouts=layouts_of(plan), deferred=None)
    assert entry.install is not None
    ours_hook = entry.install(ctx, entry, create_lora_capture_hook)(config, ours_runner)
    vllm_us, ours_us = time_hook(vllm_hook, graphs), time_hook(ours_hook, graphs)
    assert vllm_runner.calls == ours_runner.calls == ROUNDS * len(graphs)
    sizes = statistics.median(t for _, _, t in graphs)
    print(f"capture hook, {len(graphs)} LoRA graphs of {path.name} (median {sizes:.0f} tokens), best of {ROUNDS}:")
    print(f"  vLLM {vllm_us:8.1f} us/graph   capplan {ours_us:8.1f} us/graph   ratio {ours_us / vllm_us:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
