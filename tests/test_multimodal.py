"""Multimodal specs: the encoder section, encoder graphs in the plan, failure class 11 and its fix."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from capplan.analysis.diff import diff_plans
from capplan.analysis.verify import verify_plan
from capplan.calibration.price import load_pricer
from capplan.cli import app
from capplan.errors import CapplanError
from capplan.loading import spec_from_data
from capplan.planfile import load_plan
from capplan.planner import compile_plan
from capplan.planner.encoder import EncoderGraphs, pack, power_budgets, resolve_encoder_graphs
from capplan.runtime.engine_check import config_problem
from capplan.schemas.spec import Fix

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _spec(mm: dict | None = None, **top):
    data = {"target": {"vllm": "0.33"}, "lora": {"enabled": True, "max_loras": 2, "specialize_active": True}}
    data.update(top)
    if mm is not None:
        data["multimodal"] = {
            "tower_connector_lora": True,
            "encoder_cudagraphs": True,
            "budget_range": [64, 4096],
            **mm,
        }
    return spec_from_data(data, "mm")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {
                "target": {"vllm": "0.25"},
                "lora": {"enabled": True},
                "multimodal": {"encoder_cudagraphs": True, "budget_range": [1, 2]},
            },
            "captures no encoder graphs",
        ),  # fmt: skip
        ({"multimodal": {"tower_connector_lora": True}}, "needs lora.enabled"),
        ({"multimodal": {"encoder_cudagraphs": True}}, "needs budget_range"),
        ({"multimodal": {"encoder_cudagraphs": True, "budget_range": [512, 64]}}, "min above max"),
        (
            {"multimodal": {"encoder_cudagraphs": True, "budget_range": [64, 512], "video": True}},
            "max_frames_per_video",
        ),
        ({"fixes": ["encoder_lora_eager"]}, "multimodal spec only"),
    ],
)
def test_bad_multimodal_specs_name_the_field(data, message):
    with pytest.raises(CapplanError, match=message):
        spec_from_data(data, "mm")


def test_encoder_lora_eager_is_a_default_fix_only_where_it_applies():
    assert Fix.encoder_lora_eager in _spec({}).fixes
    assert Fix.encoder_lora_eager not in _spec({"tower_connector_lora": False}).fixes
    assert Fix.encoder_lora_eager not in spec_from_data({}, "text").fixes
    assert _spec({}, fixes=[]).fixes == []


def test_budget_resolution_follows_vllms_rules():
    assert power_budgets(64, 4096) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert power_budgets(100, 5000) == [100, 200, 400, 800, 1600, 3200, 5000]
    auto = resolve_encoder_graphs(_spec({}))
    assert (auto.budgets, auto.max_items, auto.max_frames) == ([64, 128, 256, 512, 1024, 2048, 4096], 64, 0)
    items = resolve_encoder_graphs(_spec({"max_vision_items_per_batch": 200}))
    assert items.budgets == [200, 400, 800, 1600, 3200, 4096] and items.max_items == 200
    video = resolve_encoder_graphs(_spec({"video": True, "max_frames_per_video": 8}))
    assert video.max_frames == 64 * 8
    with pytest.raises(CapplanError, match="must be <= the smallest token budget"):
        resolve_encoder_graphs(_spec({"token_budgets": [8, 64], "max_vision_items_per_batch": 16}))


def test_packing_fills_batches_and_sends_oversized_items_eager():
    graphs = EncoderGraphs([512, 1024, 4096], max_items=4, max_frames=0)
    batches = pack(graphs, [100, 700, 3000, 50, 20, 10])
    assert batches == [([5, 4, 3, 0], 512), ([1, 2], 4096)]
    assert pack(graphs, [5000]) == [([0], None)]  # above the largest budget: eager
    # 0.32+ starts a new batch for an item that alone needs at least the batch's budget
    # when the two alone cost less than together; 0.31 does not
    g = EncoderGraphs([64, 128, 256, 512, 1024, 2048, 4096], 64, 0)
    assert pack(g, [100, 200, 3000, 50]) == [([3], 64), ([0], 128), ([1, 2], 4096)]
    assert pack(g, [100, 200, 3000, 50], defer=False) == [([3, 0, 1, 2], 4096)]


def test_plan_encoder_section_and_fix():
    fixed = compile_plan(_spec({}))
    assert fixed.encoder.budgets == [] and fixed.encoder.vllm_budgets == [4096, 2048, 1024, 512, 256, 128, 64]
    assert "set_active_mm_loras" in fixed.encoder.lora
    assert verify_plan(fixed).ok
    (dev,) = [d for d in fixed.deviations if d.fix == "encoder_lora_eager"]
    assert dev.failure_class.startswith("11:") and "runs eager" in dev.changes[0]
    vllm = compile_plan(_spec({}, fixes=[]))
    assert vllm.encoder.budgets == vllm.encoder.vllm_budgets
    kinds = {v.kind for v in verify_plan(vllm).violations}
    assert "encoder_lora" in kinds
    safe = compile_plan(_spec({}, lora={"enabled": True, "max_loras": 2, "specialize_active": False}))
    assert safe.encoder.budgets == safe.encoder.vllm_budgets  # specialize_active off: the graphs are safe
    assert "encoder_lora" not in {v.kind for v in verify_plan(safe).violations}
    text = compile_plan(spec_from_data({}, "text"))
    assert text.encoder is None


def test_multimodal_plan_file_round_trip_and_tamper(tmp_path):
    spec = tmp_path / "vl.yaml"
    spec.write_text((ROOT / "configs" / "vl-tower-lora.yaml").read_text())
    plan = tmp_path / "vl.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    loaded = load_plan(plan)
    assert loaded.encoder.vllm_budgets[0] == 8192
    text = plan.read_text()
    assert 'vllm_graphs: ["ENCODER:8192"' in text
    plan.write_text(text.replace('"ENCODER:8192", ', "", 1))
    result = runner.invoke(app, ["show", str(plan)])
    assert result.exit_code == 1 and "encoder" in result.output


def test_engine_config_is_checked_for_the_encoder_settings():
    plan = compile_plan(_spec({}, lora={"enabled": True, "max_loras": 2, "specialize_active": False}))
    spec = plan.spec

    def config(tower: bool, encoder: bool, budgets=()):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(
                cudagraph_mode=SimpleNamespace(name=spec.cudagraph.mode.value),
                cudagraph_capture_sizes=plan.capture_sizes,
                max_cudagraph_capture_size=plan.max_capture_size,
                cudagraph_specialize_lora=True,
                cudagraph_mm_encoder=encoder,
                encoder_cudagraph_token_budgets=list(budgets),
                encoder_cudagraph_max_vision_items_per_batch=0,
                encoder_cudagraph_max_frames_per_batch=None,
            ),
            scheduler_config=SimpleNamespace(
                max_num_seqs=spec.scheduler.max_num_seqs, max_num_batched_tokens=spec.scheduler.max_num_batched_tokens
            ),
            model_config=SimpleNamespace(max_model_len=spec.scheduler.max_model_len),
            lora_config=SimpleNamespace(max_loras=2, specialize_active_lora=False, enable_tower_connector_lora=tower),
            speculative_config=None,
            parallel_config=SimpleNamespace(data_parallel_size=1),
        )

    assert config_problem(plan, "p", config(True, True)) is None
    assert "multimodal.tower_connector_lora: plan True, engine False" in config_problem(plan, "p", config(False, True))
    assert "multimodal.encoder_cudagraphs: plan True, engine False" in config_problem(plan, "p", config(True, False))
    assert "multimodal.token_budgets" in config_problem(plan, "p", config(True, True, [512]))
    text_plan = compile_plan(
        spec_from_data({"target": {"vllm": "0.33"}, "lora": {"enabled": True, "max_loras": 2}}, "t")
    )
    assert "multimodal.encoder_cudagraphs: plan False, engine True" in config_problem(
        text_plan, "p", config(False, True)
    )


def test_diff_names_encoder_changes():
    old = compile_plan(_spec({}))
    new = compile_plan(_spec({}, lora={"enabled": True, "max_loras": 2, "specialize_active": False}))
    d = diff_plans(old, new, load_pricer())
    from capplan.present.diff import diff_json, encoder_lines

    assert any(c.startswith("graphs: none (eager) -> ENCODER:4096") for c in encoder_lines(d))
    assert [r["text"] for r in diff_json(d)["encoder_changes"]] == encoder_lines(d)


def test_dispatch_encoder_items(tmp_path):
    spec = tmp_path / "vl.yaml"
    spec.write_text(
        'target: {vllm: "0.33"}\nlora: {enabled: true, max_loras: 2}\n'
        "multimodal: {tower_connector_lora: true, encoder_cudagraphs: true, budget_range: [64, 4096]}\n"
    )
    plan = tmp_path / "vl.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    result = runner.invoke(app, ["dispatch", str(plan), "--encoder-items", "100,200,3000,50,9000", "--json"])
    assert result.exit_code == 0, result.output
    import json

    rows = json.loads(result.output)
    assert [(r["items"], r["graph"]) for r in rows] == [
        ([3], "ENCODER:64"),
        ([0], "ENCODER:128"),
        ([1, 2], "ENCODER:4096"),
        ([4], None),
    ]
    text = runner.invoke(app, ["dispatch", str(plan), "--encoder-items", "9000"]).output
    assert text.startswith("eager: items [0] (9000 tokens; above the largest budget)")
    for bad in ("1,x", "0", ""):
        result = runner.invoke(app, ["dispatch", str(plan), "--encoder-items", bad])
        assert result.exit_code == 2 and "--encoder-items" in result.output
    text_plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    result = runner.invoke(app, ["dispatch", str(text_plan), "--encoder-items", "5"])
    assert result.exit_code == 2 and "no multimodal encoder" in result.output
