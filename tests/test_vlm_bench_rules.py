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


def test_graphs_control_is_vanilla_without_tower_lora_and_the_control_with_graphs():
    vanilla = vlm_lora.engine_kwargs("vanilla", MODEL, False, True)
    graphs_control = vlm_lora.engine_kwargs("graphs_control", MODEL, False, True)
    control = vlm_lora.engine_kwargs("control", MODEL, False, True)
    assert graphs_control["compilation_config"]["cudagraph_mm_encoder"] is True
    assert (
        graphs_control["compilation_config"]
        == vlm_lora.engine_kwargs("planned", MODEL, False, True)["compilation_config"]
    )
    assert graphs_control["enable_tower_connector_lora"] is False
    assert {k for k in {*vanilla, *graphs_control} if vanilla.get(k) != graphs_control.get(k)} == {
        "enable_tower_connector_lora"
    }
    assert {k for k in {*control, *graphs_control} if control.get(k) != graphs_control.get(k)} == {
        "enforce_eager",
        "compilation_config",
    }
    assert not vlm_lora.ENGINES["graphs_control"]["plan"] and "graphs_control" in vlm_lora.STAGE_CAP_S
    # five engines started together stay within half of the GPU
    assert len(vlm_lora.ENGINES) == 5 and len(vlm_lora.ENGINES) * vlm_lora.GPU_SHARE <= 0.5


def _rows(changed=(), near_tie=False, groups=None):
    """Every request's answer, the same in every engine unless (group, req) is in `changed` (its
    last token differs); near_tie: every step's top-1/top-2 gap is a near-tie (as a reference's)."""
    rows = []
    for r in vlm_lora.requests():
        if groups is not None and r["group"] not in groups:
            continue
        gap = -0.3 if near_tie else -5.0
        tokens = [1, 2, 3, 9 if (r["group"], r["req"]) in changed else 4]
        rows.append({**r, "tokens": tokens, "top": [[[t, -0.1], [t + 100, gap]] for t in tokens]})
    return rows


def _stage(rows, ok=True, group_running=None):
    st = {"ok": ok, "results": rows}
    if group_running:
        st["group_running"] = group_running
    return st


def _verdict(**stages):
    data = {"settings": {"encoder_graphs": True}, "stages": stages}
    return vlm_lora.evaluate(data)["verdict"]


IMAGE_REQ = ("pair", 0)  # image 3, no adapter
TEXT_REQ = ("mixed8", 6)  # no image, no adapter


def test_graphs_equal_to_the_control_blame_tower_lora_under_graphs():
    v = _verdict(
        reference=_stage(_rows()),
        planned=_stage(_rows(changed={IMAGE_REQ})),
        control=_stage(_rows()),
        graphs_control=_stage(_rows()),
    )
    assert v["encoder_graphs_alone_change_image_outputs"] is False
    assert v["image_differences_cause"].startswith("tower/connector LoRA under graphs")
    assert v["image_differences_in"] == ["planned"]
    assert v["crash_needs_tower_lora"] is None and v["graph_engines_died_in"] == {}


def test_graphs_differing_from_the_control_blame_the_graphs():
    v = _verdict(
        reference=_stage(_rows()),
        planned=_stage(_rows(changed={IMAGE_REQ})),
        control=_stage(_rows()),
        graphs_control=_stage(_rows(changed={IMAGE_REQ})),
    )
    assert v["encoder_graphs_alone_change_image_outputs"] is True
    assert v["image_differences_cause"].startswith("encoder graphs themselves")
    assert v["graphs_control_vs_control_image_requests_differing_clearly"].startswith("1/")
    assert v["graphs_control_vs_control_text_only_equal"] is True


def test_near_ties_and_text_only_differences_do_not_blame_the_encoder_graphs():
    # the control's answer was a near-tie where they part
    v = _verdict(control=_stage(_rows(near_tie=True)), graphs_control=_stage(_rows(changed={IMAGE_REQ})))
    assert v["encoder_graphs_alone_change_image_outputs"] is False
    v = _verdict(control=_stage(_rows()), graphs_control=_stage(_rows(changed={TEXT_REQ})))
    assert v["encoder_graphs_alone_change_image_outputs"] is False
    assert v["graphs_control_vs_control_text_only_equal"] is False


def test_an_engine_missing_or_cut_short_leaves_the_cause_open():
    assert _verdict(control=_stage(_rows()))["encoder_graphs_alone_change_image_outputs"] is None
    v = _verdict(
        reference=_stage(_rows()),
        planned=_stage(_rows(changed={IMAGE_REQ})),
        control=_stage(_rows()),
        graphs_control=_stage(_rows(groups={"pair", "mixed4"}), ok=False, group_running="one"),
    )
    assert v["encoder_graphs_alone_change_image_outputs"] is None  # equal so far, but not on every group
    assert v["image_differences_cause"] is None
    # a clear difference on the groups answered is one all the same
    v = _verdict(
        control=_stage(_rows()),
        graphs_control=_stage(_rows(changed={IMAGE_REQ}, groups={"pair"}), ok=False, group_running="mixed4"),
    )
    assert v["encoder_graphs_alone_change_image_outputs"] is True


@pytest.mark.parametrize(
    ("graphs_control", "needs"),
    [
        (_stage(_rows()), True),  # got through the group where the others died
        (_stage(_rows(groups={"pair", "mixed4", "one", "reorder"}), ok=False, group_running="mixed8"), False),
        (_stage(_rows(groups={"pair"}), ok=False, group_running="mixed4"), None),  # died before it
        (None, None),
    ],
)
def test_crash_needs_tower_lora(graphs_control, needs):
    before = {"pair", "mixed4", "one", "reorder"}
    stages = dict(
        reference=_stage(_rows()),
        planned=_stage(_rows(groups=before), ok=False, group_running="mixed8"),
        control=_stage(_rows()),
        vanilla={"ok": False, "error": "timed out after 400 s"},  # no JSON: no group known
    )
    if graphs_control is not None:
        stages["graphs_control"] = graphs_control
    v = _verdict(**stages)
    assert v["graph_engines_died_in"] == {"planned": "mixed8"}
    assert v["crash_needs_tower_lora"] is needs
    if graphs_control is None:
        assert v["graphs_control_failed"] == "not run"


def test_a_dead_engine_core_is_seen_in_the_log_and_by_the_watch():
    import threading

    log = "INFO startup\n(MainProcess pid=1) WARNING [core_client.py:839] [shutdown] MPClient: engine core exited unexpectedly; starting cleanup\n"
    assert "exited unexpectedly" in vlm_lora.dead_engine_line(log)
    assert vlm_lora.dead_engine_line("INFO all fine\nengine vanilla: ok=True total 80.1 s\n") is None
    assert vlm_lora.dead_engine_line("engine vanilla: ok=False total 80.1 s\n") is not None
    # the watch calls on_dead once the engine core is gone and the groups did not end within the grace
    alive, done, seen = [True], threading.Event(), []
    watch = threading.Thread(
        target=vlm_lora._watch_engine_core, args=(lambda: alive[0], done, seen.append, 0.05, 0.01), daemon=True
    )
    watch.start()
    alive[0] = False
    watch.join(5)
    assert not watch.is_alive() and len(seen) == 1
    # ... and never once the groups ended (the engine core stopped on purpose)
    alive, done, seen = [True], threading.Event(), []
    watch = threading.Thread(
        target=vlm_lora._watch_engine_core, args=(lambda: alive[0], done, seen.append, 0.05, 0.01), daemon=True
    )
    watch.start()
    done.set()
    alive[0] = False
    watch.join(5)
    assert not watch.is_alive() and seen == []


def test_the_engine_core_of_this_process_is_found_alive_and_then_gone():
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert proc.pid in vlm_lora._child_pids(__import__("os").getpid())
        assert vlm_lora._proc_alive(proc.pid)
    finally:
        proc.kill()
    proc.poll()
    import time

    time.sleep(0.2)
    assert not vlm_lora._proc_alive(proc.pid)  # a zombie until reaped counts as gone
    proc.wait()
    assert not vlm_lora._proc_alive(proc.pid)


def test_every_kept_result_names_the_commit_under_test(monkeypatch):
    monkeypatch.setenv("CAPPLAN_COMMIT", "0123abc")
    stamped = vlm_lora._stamped({"engine": "planned", "ok": True})
    assert list(stamped)[0] == "capplan_commit" and stamped["capplan_commit"] == "0123abc"
    env = vlm_lora.environment()
    assert env["capplan_commit"] == "0123abc" and env["host_cpu"]
