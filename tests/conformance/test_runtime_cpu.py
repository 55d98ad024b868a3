"""The runtime against vLLM's real MRV2 classes on CPU, for each claimed release."""

import json
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from capplan.releases import RELEASES
from capplan.runtime.deferred.pauses import SLOW_BURST, Pauses
from tests.conformance.releases import releases
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready, run_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.conformance
@pytest.mark.parametrize("variant", ["", "case-sizes"])
@pytest.mark.parametrize("version", releases())
def test_plan_installed_into_real_manager(version, variant, tmp_path):
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    out = tmp_path / "report.json"
    run_check("runtime_check.py", version, out, variant)
    report = json.loads(out.read_text())
    assert report["vllm"] == version
    assert report["capture_list_equals_plan"] is True
    if variant == "case-sizes":  # fewer graphs than vLLM's every-size-every-case, installed as planned
        assert report["planned_graphs"] < report["vanilla_graphs"] - 10
    assert report["dispatch_checked"] > 5000 and report["dispatch_mismatches"] == 0
    # The start report's identity, read off vLLM's real config classes (no model on CPU: its
    # parallel sizes at least; a field this vLLM lacks is left out, never an error).
    assert report["identity"]["tensor_parallel_size"] == 1 and report["identity"]["data_parallel_size"] == 1
    assert report["eager_expected"] > 0 and report["eager_counted"] == report["eager_expected"]
    assert report["graph_hits_counted"] == report["dispatch_checked"] - report["eager_expected"]
    assert report["step_counted"] == 1 and report["dispatch_after_steps_counted"] == 0
    assert report["slots_for_2_adapters_plus_base"] == 3
    assert report["case5_prompt_ids"] == [0, 1, 2, 3, 4]  # 0 is vLLM's "no adapter" id
    assert report["case5_tokens"] is True
    assert report["case5_requests"] == [1, 2, 3, 4]
    assert "does not match this engine" in report["mismatch_error"]
    assert "lora.max_loras: plan 4, engine 8" in report["mismatch_error"]
    assert "Nothing was captured" in report["mismatch_error"]
    # The runtime contract holds on this release, and the early (pre-spawn) check reads its config.
    assert report["contract_problems"] == [] and report["contract_entries"] >= 10
    # Removing a registry entry removes its hook; every entry that applies is installed.
    assert report["removed_entry_untouched"] is True
    assert report["hooks_installed"] >= 8 and report["hooks_unmarked"] == []
    assert report["manager_state_present"] is True and report["config_fields_exist"] == []
    assert report["capture_state_present"] is True
    assert report["profiling_mark"] == ("None" if RELEASES[version].profiling_capture else "'absent'")
    assert report["early_check_same_engine"] is None and report["uses_v2_runner_attribute"] is True
    assert "scheduler.max_num_seqs: plan 16, engine 17" in report["early_check_other_engine"]
    assert "Refused before the engine started" in report["early_check_other_engine"]
    # VLLM_USE_BREAKABLE_CUDAGRAPH=1 changes the captured graphs only on 0.26.0: refused there.
    assert report["breakable_off_refusal"] is None
    if RELEASES[version].breakable_pads_requests:
        assert "VLLM_USE_BREAKABLE_CUDAGRAPH is on" in report["breakable_refusal"]
        assert report["breakable_manager_refusal"] == report["breakable_refusal"]  # in every capturing process
    else:
        assert report["breakable_refusal"] is None and report["breakable_manager_refusal"] is None
    # Dummy runs outside capture: vLLM's real _dummy_run builds what the plan says it does,
    # and with the plan in force what the plan says capplan makes it do.
    assert report["dummy_vllm_layout_as_planned"] is True
    piled = not RELEASES[version].rules.spreads_dummy_remainder
    assert report["dummy_vllm_layout"] == ([[99, 81], [1, 173]] if piled else [[8, 81], [92, 82]])
    assert report["dummy_hooked_as_planned"] is True and report["dummy_attributes_restored"] is True
    assert report["dummy_hooked_scheduler"] == [[8, 81], [92, 82]]


def test_plugin_is_registered_for_vllm():
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "capplan"]
    assert plugin.value == "capplan.runtime.plugin:register"
    register = plugin.load()
    os.environ.pop("CAPPLAN_PLAN", None)
    assert register() is None  # no plan named: the plugin does nothing


def test_plugin_refuses_a_bad_plan(tmp_path, monkeypatch):
    from capplan.runtime.plugin import register

    bad = tmp_path / "x.plan.yaml"
    bad.write_text("format_version: 9\n")
    monkeypatch.setenv("CAPPLAN_PLAN", str(bad))
    with pytest.raises(SystemExit, match="format_version: 9 is newer"):
        register()


def test_plugin_refuses_the_v1_runner_before_loading_anything(tmp_path, monkeypatch):
    from capplan.runtime.plugin import register

    monkeypatch.setenv("CAPPLAN_PLAN", str(ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(SystemExit, match="VLLM_USE_V2_MODEL_RUNNER=0 puts the engine on vLLM's V1 model runner"):
        register()


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_trace_recorder_in_real_runner(version, tmp_path):
    """capplan's execute_model wrapper on vLLM's real GPUModelRunner (signature, contract):
    real steps are recorded with the LoRA count the lora_slot hook made for the same step;
    dummy runs and vLLM's warm-up steps are not; what vLLM returns is passed through."""
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    trace, out = tmp_path / "trace.jsonl", tmp_path / "report.json"
    run_check("recorder_runtime_check.py", version, trace, out)
    report = json.loads(out.read_text())
    assert report["results"] == ["ran"] * 5
    lines = [json.loads(line) for line in trace.read_text().splitlines() if line.startswith("{")]
    for line in lines:
        line.pop("t")
    assert lines == [
        {"num_reqs": 4, "num_tokens": 4, "max_query_len": 1, "num_active_loras": 2, "base": True},
        {"num_reqs": 2, "num_tokens": 301, "max_query_len": 300, "num_active_loras": 2, "has_prefill": True},
        {"num_reqs": 1, "num_tokens": 1, "max_query_len": 1},
    ]
    assert report["recorder"]["steps"] == 3 and report["recorder"]["overhead_us_per_step"] > 0
    # the engine's parallel sizes in the header, read back for calibrate-trace
    from capplan.batches import trace_layout

    assert trace_layout(trace) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}


@pytest.mark.conformance
@pytest.mark.parametrize("version", releases())
def test_deferred_capture_in_real_manager(version, tmp_path):
    """Deferred capture's hooks around vLLM's real manager: start-up captures the ready graphs
    only, steps capture between steps only (a slow capture only for a graph the traffic missed,
    spaced), the idle loop captures the rest, most missed first, and
    in every intermediate state every batch replays a captured graph that fits it."""
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    out = tmp_path / "deferred.json"
    run_check("deferred_runtime_check.py", version, out)
    report = json.loads(out.read_text())
    assert report["vllm"] == version
    assert report["startup_captured_ready_in_plan_order"] and report["capture_list_restored"]
    # Without vLLM's profiling pass (before 0.29.0) the start-up capture also samples each mode's
    # deferred graphs, spread over them and at most half, which stay captured; with it, none, but
    # the deferred graphs in plan order while each takes no memory (here every one, to the limit).
    assert report["startup_sampled_as_planned"]
    assert (report["sampled_at_start"] > 0) is (not RELEASES[version].profiling_capture)
    assert (report["free_at_start"] > 0) is RELEASES[version].profiling_capture
    assert report["deferred"] > 10  # graphs are still captured while serving
    assert report["captures_while_sampling_pending"] == 0
    assert report["captures_in_4_steps_every_2"] == 2 and report["one_graph_per_capture"]
    assert report["capture_times_measured"] and report["slow_captures_left_to_idle"]
    # Under sustained load (no idle turn, every capture over the step budget) the graph the traffic
    # missed, last in the queue, lands on a step turn first, and slow step captures stay spaced.
    assert report["miss_counted"] and report["missed_graph_landed_first_under_load"]
    assert report["slow_step_captures_spaced"] and report["default_pauses"]
    assert report["operator_spacing_0_never_pauses"] and report["operator_bound_above_captures_lands"]
    # Many graphs missed at once: a burst lands at once, the rest paced by the spacing.
    assert report["burst_graphs_missed"] == 2 + 2  # the check's burst of 2, and 2 more
    assert SLOW_BURST == Pauses().slow_burst == 8 and f"burst of {SLOW_BURST}" in (ROOT / "docs" / "cli.md").read_text()
    assert report["burst_lands_at_once"] and report["burst_all_landed"] and report["burst_paced_after"]
    assert report["multi_rank_steps_never_capture"]
    assert report["step_result_passed_through"] and report["output_takes_capture_lock"]
    assert report["idle_loop_returns_original"] and report["busy_loop_calls_no_rpc"]
    assert report["idle_loop_handled_utility_request"] and report["asleep_no_capture"]
    # The idle loop is vLLM's own: it never blocks while a capture is pending and the core is
    # awake, blocks as before while asleep or once none is pending, and input comes first.
    assert report["asleep_blocks_as_vllm"] and report["idle_turns_never_block"] and report["input_turn_no_capture"]
    assert report["aborts_queue_drained_as_vllm"] and report["startup_used_vllm_hook"]
    # Deferred LoRA graphs set the punica mapping only, slot i read as adapter i + 1, and leave
    # the live slot table as it was with the last mapping forgotten; dummy rows point at block 0.
    assert report["deferred_lora_mappings"] and report["slots_during_capture"] == [[1, 2, 3, 4]]
    assert report["live_slots_restored"] and report["last_mapping_forgotten"]
    assert report["case4_prompt_ids"] == [1, 2, 3, 4] and report["block_tables_zeroed"]
    assert report["pending_after_idle"] == 0 and report["final_set_is_the_plan"]
    assert report["deferred_captured_each_once"]
    assert report["states_checked"] == report["deferred"] + 3  # start-up, each deferred capture, the last idle turn
    assert report["problems"] == [] and report["batches_checked"] > 100_000
    assert report["fallback_steps_counted"] > 0  # the intermediate states did replay fallbacks
    assert report["report_json"]["captured"] == report["deferred"]
    # The attention builders' threshold made the first graph of each attention kernel ready at
    # the first capture (the profiling pass where there is one), before anything was sized.
    assert report["warmed"] > 0 and len(report["report_json"]["warmed_for_attention"]) == report["warmed"]
    assert report["report_json"]["attention_thresholds"] == [8]
    if RELEASES[version].profiling_capture:  # vLLM's profiling capture: ready and sampled graphs, one per call
        assert report["profiling_calls_as_planned"] and report["profiling_left_captured_pw_and_all_full"]
        assert report["profiling_samples_deferred_graphs"]
        assert report["profiling_did_not_start_deferral"] and report["profiled_estimate_plus_extra"]
    else:
        assert "profiling_calls_as_planned" not in report
