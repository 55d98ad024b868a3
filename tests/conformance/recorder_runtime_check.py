"""The trace recorder's hook on vLLM's real GPUModelRunner.execute_model, on CPU.

Run in the oracle venv: PYTHONPATH=SRC/<version>:REPO/src:REPO python recorder_runtime_check.py TRACE OUT.json
vLLM's execute_model is replaced, before capplan installs, by a stand-in with the same
parameters that does what the real one does for the recorder: it asks the module's
`get_num_active_loras_for_dispatch` (capplan's lora_slot hook) for the step's LoRA count.
Then real steps, a dummy run and a warm-up step go through capplan's wrapper.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import vllm  # noqa: F401
import vllm.v1.worker.gpu.model_runner as runner_mod

from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.runtime import registry
from capplan.runtime.versions import detect_release


def stand_in(real):
    """A function with `real`'s parameters that calls the LoRA count the way vLLM does."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        dummy = kwargs.get("dummy_run", False)
        runner_mod.get_num_active_loras_for_dispatch(self.lora_config, self.lora_state, req_ids, dummy)
        return "ran"

    execute_model.__signature__ = inspect.signature(real)
    return execute_model


class LoraState:
    def __init__(self, adapters: dict[str, str]) -> None:
        self.lora_requests = adapters

    def get_activate_loras(self, req_ids):
        return {self.lora_requests[r] for r in req_ids if r in self.lora_requests}


def main(trace: Path, out: Path) -> None:
    release = detect_release(vllm.__version__).version
    os.environ["CAPPLAN_TRACE"] = str(trace)
    runner_cls = runner_mod.GPUModelRunner
    runner_cls.execute_model = stand_in(runner_cls.execute_model)
    spec = spec_from_data({"target": {"vllm": release}, "lora": {"enabled": True, "max_loras": 4}}, "recorder")
    state = registry.install(compile_plan(spec), "recorder.plan.yaml")
    runner = SimpleNamespace(
        lora_config=SimpleNamespace(max_loras=4),
        lora_state=LoraState({"a": "lora1", "b": "lora2", "c": "lora1"}),
        dp_rank=0,
        dp_size=1,
        decode_query_len=1,
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
    )

    def step(counts: dict[str, int], **kwargs) -> object:
        output = SimpleNamespace(num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()))
        return runner_cls.execute_model(runner, output, **kwargs)

    results = [
        step({"a": 1, "b": 1, "c": 1, "d": 1}),  # 2 adapters + a base request, decode
        step({"a": 300, "b": 1}),  # 2 adapters, a prefill chunk
        step({"x": 5, "y": 5}, dummy_run=True),  # a dummy run: not traffic
        step({"_warmup_0_": 8, "_warmup_1_": 8}),  # vLLM's start-up warm-up: not traffic
        step({"d": 1}),  # base only
    ]
    state.report.recorder.close()
    out.write_text(json.dumps({"results": results, "recorder": state.report.recorder.to_json()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
