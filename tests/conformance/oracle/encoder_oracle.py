#!/usr/bin/env python3
"""Test oracle for encoder CUDA graphs: vLLM's own EncoderCudaGraphManager on CPU.

Standalone on purpose (standard library, torch and vLLM only, never capplan):

    PYTHONPATH=CACHE/src/0.33.0 CACHE/venv/bin/python encoder_oracle.py --input IN.json --output OUT.json

IN.json:  {"cases": [{"name": str, "compilation": {"encoder_cudagraph_token_budgets": [...],
          "encoder_cudagraph_max_vision_items_per_batch": int, "encoder_cudagraph_max_frames_per_batch":
          int|null}, "budget_range": [lo, hi], "video": bool, "max_frames_per_video": int,
          "batches": [[item output tokens, ...], ...]}, ...]}
OUT.json: {"vllm_version": str, "results": [{"name", "token_budgets", "max_items", "max_frames",
          "capture_order": [budget, ...], "packing": [[[indices], budget|null], ...] per batch}
          or {"name", "error"}]}

Real vLLM code: EncoderCudaGraphManager.__init__ (budget, item and frame
resolution), capture() (the order it captures budgets in; the per-budget
capture itself is recorded, not run), _execute_local (packing and the budget
or eager decision per packed batch). Faked: the VllmConfig (a namespace with
the fields the manager reads), the model (budget range, config, item specs),
and the graph replay / eager forward, which only record what was asked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager  # noqa: E402
from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig, EncoderItemSpec  # noqa: E402


class FakeModel:
    """What the manager asks of a model: its config, budget range, items; forwards recorded."""

    def __init__(self, case: dict, log: list) -> None:
        self.case, self.log = case, log
        self.items: list[int] = []

    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        modalities = ["image", "video"] if self.case.get("video") else ["image"]
        return EncoderCudaGraphConfig(
            modalities=modalities,
            buffer_keys=["pixel_values"],
            out_hidden_size=8,
            max_frames_per_video=self.case.get("max_frames_per_video") or 1,
        )

    def get_encoder_cudagraph_budget_range(self, vllm_config) -> tuple[int, int]:
        lo, hi = self.case.get("budget_range") or (0, 0)
        return lo, hi

    def get_encoder_cudagraph_item_specs(self, mm_kwargs) -> list[EncoderItemSpec]:
        return [EncoderItemSpec(input_size=self.items[i], output_tokens=self.items[i]) for i in mm_kwargs["idx"]]

    def select_encoder_cudagraph_items(self, mm_kwargs, indices) -> dict:
        return {"idx": [mm_kwargs["idx"][i] for i in indices]}

    def encoder_eager_forward(self, mm_kwargs, path="default"):
        self.log.append((list(mm_kwargs["idx"]), None))
        return torch.zeros(1)

    def postprocess_encoder_output(self, graph_outputs, batch_indices, per_item_out_tokens, out, **kwargs):
        for i in batch_indices:
            out[i] = torch.zeros(1)


def run_case(case: dict) -> dict:
    log: list = []
    model = FakeModel(case, log)
    comp = {
        "encoder_cudagraph_token_budgets": [],
        "encoder_cudagraph_max_vision_items_per_batch": 0,
        "encoder_cudagraph_max_frames_per_batch": None,
        **case.get("compilation", {}),
    }
    video = bool(case.get("video"))
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(**comp),
        model_config=SimpleNamespace(
            multimodal_config=SimpleNamespace(
                get_limit_per_prompt=lambda modality: (1 if video else 0) if modality == "video" else 1,
                mm_encoder_tp_mode="weights",
            )
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    manager = EncoderCudaGraphManager(config, torch.device("cpu"), torch.float32, model)
    order: list[int] = []
    manager._capture_budget_graph = lambda budget, path="default", axis_keys=(): order.append(budget)
    manager.capture(graph_pool=None)

    def replay(mm_kwargs, token_budget, path="default", axis_keys=()):
        log.append((list(mm_kwargs["idx"]), token_budget))
        return torch.zeros(1)

    manager._run_budget_graph = replay
    packing = []
    for items in case.get("batches", []):
        model.items = items
        log.clear()
        with torch.inference_mode():
            manager._execute_local({"idx": list(range(len(items)))})
        packing.append([[idx, budget] for idx, budget in log])
    return {
        "name": case["name"],
        "token_budgets": list(manager.token_budgets),
        "max_items": manager.max_batch_size,
        "max_frames": manager.max_frames_per_batch,
        "capture_order": order,
        "packing": packing,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    with open(args.input) as handle:
        cases = json.load(handle)["cases"]
    results = []
    for case in cases:
        try:
            results.append(run_case(case))
        except (ValueError, AssertionError) as exc:
            results.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}"})
        except Exception:  # noqa: BLE001 - report, do not hide, an oracle crash
            traceback.print_exc()
            return 1
    with open(args.output, "w") as handle:
        json.dump({"vllm_version": vllm.__version__, "results": results}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
