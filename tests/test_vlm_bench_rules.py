"""tests/gpu/vlm_lora.py on CPU: the spec it writes compiles for the releases with encoder graphs,
its planned engine's settings are the plan's (capplan's own in-engine check), and a command it
cannot run stops with one line."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.runtime.engine_check import config_problem

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import vlm_lora  # noqa: E402

MODEL = Path("/m")


def _plan(release: str, encoder_graphs: bool):
    text = vlm_lora.spec_text(release, specialize_active=False, encoder_graphs=encoder_graphs)
    return compile_plan(spec_from_data(yaml.safe_load(text), "vlm.yaml"))


def _config(kwargs: dict) -> SimpleNamespace:
    """The VllmConfig LLM(**kwargs) builds, as far as the plan's settings go: vLLM's defaults where
    the keywords leave a setting out (cudagraph_specialize_lora on, no encoder budgets or items, frames
    left to vLLM, balanced performance mode, one rank)."""
    comp = kwargs.get("compilation_config", {})
    return SimpleNamespace(
        performance_mode="balanced",
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name=comp["cudagraph_mode"]),
            cudagraph_capture_sizes=list(comp["cudagraph_capture_sizes"]),
            max_cudagraph_capture_size=max(comp["cudagraph_capture_sizes"]),
            cudagraph_specialize_lora=True,
            cudagraph_mm_encoder=comp.get("cudagraph_mm_encoder", False),
            encoder_cudagraph_token_budgets=list(comp.get("encoder_cudagraph_token_budgets", [])),
            encoder_cudagraph_max_vision_items_per_batch=comp.get("encoder_cudagraph_max_vision_items_per_batch", 0),
            encoder_cudagraph_max_frames_per_batch=comp.get("encoder_cudagraph_max_frames_per_batch"),
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=kwargs["max_num_seqs"], max_num_batched_tokens=kwargs["max_num_batched_tokens"]
        ),
        model_config=SimpleNamespace(max_model_len=kwargs["max_model_len"], is_moe=False),
        lora_config=SimpleNamespace(
            max_loras=kwargs["max_loras"],
            max_lora_rank=kwargs["max_lora_rank"],
            specialize_active_lora=kwargs["specialize_active_lora"],
            enable_tower_connector_lora=kwargs["enable_tower_connector_lora"],
        ),
        speculative_config=None,
        parallel_config=SimpleNamespace(
            data_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            enable_dbo=False,
            enable_elastic_ep=False,
        ),
    )


@pytest.mark.parametrize("release", ["0.28.0", "0.33.0"])
def test_the_encoder_graph_spec_compiles_and_fits_the_planned_engine(release):
    plan = _plan(release, encoder_graphs=True)
    assert plan.encoder is not None
    assert plan.encoder.budgets == plan.encoder.vllm_budgets == sorted(vlm_lora.ENCODER_BUDGETS, reverse=True)
    assert (plan.encoder.max_items, plan.encoder.max_frames) == (vlm_lora.ENCODER_ITEMS, 0)
    planned = vlm_lora.engine_kwargs("planned", MODEL, specialize_active=False, encoder_graphs=True)
    assert config_problem(plan, "vlm.plan.yaml", _config(planned)) is None
    # vLLM alone runs the planned engine's settings, without the plan
    assert vlm_lora.engine_kwargs("vanilla", MODEL, False, True) == planned
    # the eager reference differs from the planned engine in nothing but graphs
    reference = vlm_lora.engine_kwargs("reference", MODEL, False, True)
    assert {k for k in {*planned, *reference} if planned.get(k) != reference.get(k)} == {
        "enforce_eager",
        "compilation_config",
    }


def test_an_engine_without_encoder_graphs_is_refused_by_the_encoder_graph_plan():
    plan = _plan("0.28.0", encoder_graphs=True)
    planned = vlm_lora.engine_kwargs("planned", MODEL, specialize_active=False, encoder_graphs=False)
    problem = config_problem(plan, "vlm.plan.yaml", _config(planned))
    assert problem is not None and "multimodal.encoder_cudagraphs" in problem


@pytest.mark.parametrize(
    ("version", "encoder_graphs", "message"),
    [
        (None, False, "vLLM is not installed"),
        ("0.24.0", False, "not a release capplan supports"),
        ("0.27.1", True, "captures no encoder graphs"),
        ("0.28.0", True, None),
        ("0.33.0+cu130", True, None),
        ("0.25.1", False, None),
    ],
)
def test_release_problem(version, encoder_graphs, message):
    problem = vlm_lora.release_problem(version, encoder_graphs)
    assert problem is None if message is None else message in problem


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["w", "--stages", "build,nope"], "unknown stage(s) nope"),
        (["w", "--stages", ","], "names no stage"),
        (["w", "--limit", "0"], "--limit must be a positive number"),
        (["w", "--engine", "other"], "invalid choice"),
    ],
)
def test_bad_arguments_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        vlm_lora.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert message in last and "Traceback" not in err


BENCH = Path(__file__).resolve().parent / "gpu" / "vlm_bench.sh"


def test_vlm_bench_parses_and_refuses_a_bad_wait_in_one_line(tmp_path):
    import subprocess

    assert subprocess.run(["bash", "-n", str(BENCH)], capture_output=True).returncode == 0
    for wait in ([], ["ten"], ["-5"]):
        proc = subprocess.run(
            ["bash", str(BENCH), *wait], capture_output=True, text=True, timeout=30, env={"OUT": str(tmp_path)}
        )
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "WAIT_SECONDS must be a whole number" in proc.stderr
        assert list(tmp_path.iterdir()) == []  # stopped before anything
