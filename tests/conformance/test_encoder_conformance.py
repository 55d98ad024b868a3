"""Encoder CUDA graphs against vLLM's own EncoderCudaGraphManager (oracle/encoder_oracle.py).

For every release of the run with encoder graphs on MRV2 (the release rule
`encoder_graphs`, 0.28+): for each multimodal spec, the budgets, item and frame
limits and the capture order equal the plan's (with `fixes: []`), a spec vLLM
refuses is refused by capplan, and the packing of random encoder batches (item
counts and token sizes drawn around the budgets) equals capplan's, batch by
batch: the items of each packed batch and its budget, or eager.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from capplan.errors import CapplanError
from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.planner.encoder import pack, resolve_encoder_graphs
from capplan.releases import RELEASES
from tests.conformance import coverage
from tests.conformance.answers import answers
from tests.conformance.oracle_python import ORACLE_DIR
from tests.conformance.releases import releases
from tests.conformance.test_vllm_conformance import run_check

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(__file__).parent / "oracle" / "encoder_oracle.py"
VERSIONS = [v for v in releases() if RELEASES[v].rules.encoder_graphs]
BATCHES_PER_SPEC = 40

pytestmark = pytest.mark.conformance

MULTIMODAL = {
    "auto-64-8192": {"budget_range": [64, 8192]},
    "auto-odd-range": {"budget_range": [100, 5000]},
    "auto-narrow": {"budget_range": [1024, 1024]},
    "items-only": {"budget_range": [64, 8192], "max_vision_items_per_batch": 200},
    "items-small": {"budget_range": [256, 16384], "max_vision_items_per_batch": 3},
    "budgets-only": {"budget_range": [64, 8192], "token_budgets": [3000, 500, 9000]},
    "explicit": {"token_budgets": [512, 4096, 1024], "max_vision_items_per_batch": 4},
    "explicit-one": {"token_budgets": [2048], "max_vision_items_per_batch": 1},
    "video-auto-frames": {"budget_range": [256, 4096], "video": True, "max_frames_per_video": 8},
    "video-frames": {"budget_range": [256, 4096], "video": True, "max_frames_per_batch": 24},
    "items-above-budget": {"token_budgets": [8, 64], "max_vision_items_per_batch": 16},  # vLLM refuses
}


def _spec(mm: dict, release: str) -> dict:
    return {
        "target": {"vllm": release},
        "lora": {"enabled": True, "max_loras": 2},
        "multimodal": {"encoder_cudagraphs": True, "tower_connector_lora": True, **mm},
        "fixes": [],
    }


def _case(name: str, mm: dict) -> dict:
    rng = random.Random(name)
    top = max(mm.get("token_budgets") or [mm.get("budget_range", [1, 1])[1]])
    batches = []
    for _ in range(BATCHES_PER_SPEC):
        n = rng.choice([1, 2, 3, 5, 8, 17, 64, 300])
        batches.append([rng.randint(1, max(2, int(top * rng.choice([0.05, 0.3, 0.7, 1.2])))) for _ in range(n)])
    compilation = {
        "encoder_cudagraph_token_budgets": mm.get("token_budgets") or [],
        "encoder_cudagraph_max_vision_items_per_batch": mm.get("max_vision_items_per_batch", 0),
        "encoder_cudagraph_max_frames_per_batch": mm.get("max_frames_per_batch"),
    }
    return {
        "name": name,
        "compilation": compilation,
        "budget_range": mm.get("budget_range"),
        "video": mm.get("video", False),
        "max_frames_per_video": mm.get("max_frames_per_video", 0),
        "batches": batches,
    }


@pytest.fixture(scope="module")
def oracle() -> dict[str, dict]:
    """vLLM's answer for every case and release (tests/conformance/answers.py: cached, verified)."""
    ready = (ORACLE_DIR / "venv" / "bin" / "python").exists()
    if not VERSIONS:
        pytest.skip("no release of this run has encoder graphs on MRV2")
    results: dict[str, dict] = {}
    cases = [_case(n, mm) for n, mm in MULTIMODAL.items()]
    for version in VERSIONS:
        if not ready or not (ORACLE_DIR / "src" / version / "vllm").is_dir():
            if os.environ.get("CAPPLAN_REQUIRE_ORACLE") == "1":
                pytest.fail(f"vLLM oracle required but {ORACLE_DIR}/src/{version} is missing")
            pytest.skip("vLLM oracle not available; run .ci/run")
        results[version] = answers(ORACLE, version, cases, list_key="cases", timeout=600)
    return results


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_encoder_graphs_and_packing_match_vllm(oracle, version, name):
    want = oracle[version][name]
    try:
        spec = spec_from_data(_spec(MULTIMODAL[name], version), name)
        graphs = resolve_encoder_graphs(spec)
    except CapplanError as exc:
        assert "error" in want, f"capplan refused what vLLM {version} accepts: {exc.one_line()}"
        coverage.compared("encoder", name, version, {"refusal": 1})
        return
    assert "error" not in want, f"vLLM {version} refuses ({want.get('error')}) what capplan plans"
    assert graphs is not None
    assert graphs.budgets == want["token_budgets"]
    assert (graphs.max_items, graphs.max_frames) == (want["max_items"], want["max_frames"])
    plan = compile_plan(spec)
    assert plan.encoder is not None and plan.encoder.budgets == want["capture_order"]  # fixes: [] is vLLM
    defer = spec.rules.encoder_packing_defers  # from 0.32: an item that would double the budget waits
    case = _case(name, MULTIMODAL[name])
    for items, packed in zip(case["batches"], want["packing"]):
        ours = [[sorted(idx), budget] for idx, budget in pack(graphs, items, defer=defer)]
        theirs = [[sorted(idx), budget] for idx, budget in packed]
        assert ours == theirs, f"items {items}"
    fields = {
        "token_budgets": 1,
        "max_items_and_frames": 1,
        "capture_order": 1,
        "packing": min(len(case["batches"]), len(want["packing"])),
    }
    coverage.compared("encoder", name, version, fields)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", ["eager", "graphs"])
def test_encoder_hook_in_real_manager(version, variant, tmp_path):
    """The runtime's hook on vLLM's EncoderCudaGraphManager.capture: under encoder_lora_eager
    nothing is captured and vLLM's manager reports no graphs (so the encoder runs eager);
    otherwise vLLM captures the plan's budgets, largest first; a manager whose budgets differ
    from the plan's is refused before it captures anything."""
    python = ORACLE_DIR / "venv" / "bin" / "python"
    if not python.exists() or not (ORACLE_DIR / "src" / version / "vllm").is_dir():
        if os.environ.get("CAPPLAN_REQUIRE_ORACLE") == "1":
            pytest.fail(f"vLLM oracle required but {ORACLE_DIR}/src/{version} is missing")
        pytest.skip("vLLM oracle not available; run .ci/run")
    out = tmp_path / "report.json"
    run_check("encoder_runtime_check.py", version, out, variant)
    report = json.loads(out.read_text())
    assert report["vllm_budgets"] == [4096, 2048, 1024, 512, 256, 128, 64]
    if variant == "eager":
        assert report["plan_budgets"] == [] and report["captured"] == [] and not report["is_captured"]
    else:
        assert report["plan_budgets"] == report["vllm_budgets"] == report["captured"] and report["is_captured"]
    assert "does not match this engine's encoder graphs" in report["mismatch"]
    assert report["mismatch_captured"] == []
