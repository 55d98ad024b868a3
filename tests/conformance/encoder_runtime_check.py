"""Install a multimodal plan into vLLM's real EncoderCudaGraphManager on CPU and check the hook.

Run in the oracle venv (vLLM 0.31+): PYTHONPATH=SRC/<version>:REPO/src:REPO python encoder_runtime_check.py
OUT.json VARIANT, VARIANT "eager" (tower LoRA + specialize_active: encoder_lora_eager applies) or
"graphs" (specialize_active off: the plan keeps vLLM's encoder graphs). Writes a JSON report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "conformance" / "oracle"))

import torch  # noqa: E402
import vllm  # noqa: E402
from encoder_oracle import FakeModel  # noqa: E402
from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import compile_plan  # noqa: E402
from capplan.runtime import registry  # noqa: E402
from capplan.runtime.engine_check import PlanMismatch  # noqa: E402
from capplan.runtime.versions import detect_release  # noqa: E402


def manager(budget_range: list[int]) -> tuple[EncoderCudaGraphManager, list[int]]:
    case = {"budget_range": budget_range}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            encoder_cudagraph_token_budgets=[],
            encoder_cudagraph_max_vision_items_per_batch=0,
            encoder_cudagraph_max_frames_per_batch=None,
        ),
        model_config=SimpleNamespace(
            multimodal_config=SimpleNamespace(
                get_limit_per_prompt=lambda m: 0 if m == "video" else 1, mm_encoder_tp_mode="weights"
            )
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    built = EncoderCudaGraphManager(config, torch.device("cpu"), torch.float32, FakeModel(case, []))
    captured: list[int] = []
    built._capture_budget_graph = lambda budget, path="default", axis_keys=(): captured.append(budget)
    return built, captured


def main(out: Path, variant: str) -> None:
    spec = spec_from_data(
        {
            "target": {"vllm": detect_release(vllm.__version__).version},
            "lora": {"enabled": True, "max_loras": 2, "specialize_active": variant == "eager"},
            "multimodal": {"tower_connector_lora": True, "encoder_cudagraphs": True, "budget_range": [64, 4096]},
        },
        "encoder",
    )
    plan = compile_plan(spec)
    registry.install(plan, "encoder.plan.yaml")
    report: dict = {"plan_budgets": plan.encoder.budgets, "vllm_budgets": plan.encoder.vllm_budgets}
    same, captured = manager([64, 4096])
    same.capture(graph_pool="pool")
    report["captured"] = captured
    report["is_captured"] = same.is_captured()
    other, other_captured = manager([128, 4096])
    try:
        other.capture(graph_pool="pool")
        report["mismatch"] = None
    except PlanMismatch as exc:
        report["mismatch"] = str(exc)
    report["mismatch_captured"] = other_captured
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
