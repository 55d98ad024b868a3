"""The graph memory a start leaves free beside the KV cache from a calibration of the deployment,
in place of vLLM's throwaway profiling capture (capplan.calibration.budget, runtime.hooks.memory),
and the engine stopped before serving when the real capture outgrows it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.calibration.budget import GIB, default_margin_bytes, graph_budget, outgrown
from capplan.calibration.starts import read_report
from capplan.cli import app
from capplan.envvars import CALIBRATION, COMMAND
from capplan.envvars import GRAPH_MARGIN as MARGIN_ENV
from capplan.loading import load_calibration
from capplan.planfile import load_plan
from capplan.releases import RELEASES
from capplan.runtime import report as report_module
from capplan.runtime.hooks import manager as manager_hooks
from capplan.runtime.hooks import memory
from capplan.runtime.launch_line import command_of, its_arguments
from capplan.runtime.report import Report

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "gpu" / "results" / "startup" / "0.33.0-h100"
PLAN = RUN / "full.plan.yaml"  # Llama-3.1-8B's shape, 258 graphs
FIRST = RUN / "first-capture.calibration.yaml"  # two starts whose capture ran first: 1.1914 GiB
AFTER = ROOT / "src" / "capplan" / "data" / "calibrations" / "h100-vllm033-llama3.1-8b.yaml"  # after the pass: 0.3496
LIVE = {  # the engine of those starts, as runtime.report.deployment_identity reads it
    "shape": {"num_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "dtype": "bfloat16"},
    "model": "/srv/llama", "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "lora_rank": 16, "vllm": "0.33.0", "torch": "2.11.0", "gpu": "NVIDIA H100 80GB HBM3",
}  # fmt: skip
runner = CliRunner()


def test_the_reserve_is_the_largest_first_capture_reading_plus_the_margin():
    budget = graph_budget(load_plan(PLAN), load_calibration(FIRST), LIVE)
    assert not isinstance(budget, str), budget
    assert budget.starts == 2 and budget.spread_bytes == 0
    assert budget.measured_bytes == math.ceil((1.1914 + 0.00005) * GIB)  # the top of the report's rounding
    assert budget.reserve_bytes == budget.measured_bytes + default_margin_bytes(budget.measured_bytes)
    given_margin = graph_budget(load_plan(PLAN), load_calibration(FIRST), LIVE, 0.02)
    assert not isinstance(given_margin, str) and given_margin.margin_bytes == round(0.02 * GIB)


def test_the_default_reserve_leaves_no_less_kv_cache_than_vllms_own_estimate_did():
    # vLLM alone estimated this plan's graphs at 1.21 GiB (its log, two decimals: at least 1.205) in
    # every start of the H100 pairs; captured first they took 1.1914 GiB. The default reserve is
    # below that estimate, so `apply` sizes the KV cache no smaller than vLLM alone (a 10% margin,
    # 1.31 GiB, cost 864 tokens).
    summary = json.loads((RUN / "pairs" / "summary.json").read_text())
    estimates = summary["arms"]["vllm"]["pool_estimated_gib"]
    assert len(estimates) == 5
    budget = graph_budget(load_plan(PLAN), load_calibration(FIRST), LIVE)
    assert not isinstance(budget, str), budget
    assert budget.reserve_bytes < (min(estimates) - 0.005) * GIB
    assert budget.margin_bytes >= 2 * 2**21  # two of the 2 MiB pages the readings move in


def test_the_default_margin_has_a_floor_for_small_plans():
    assert default_margin_bytes(10 * 2**20) == 4 * 2**20
    assert default_margin_bytes(2 * GIB) == round(0.005 * 2 * GIB)


def test_readings_taken_after_vllms_profiling_pass_are_no_reserve():
    # The three H100 starts read 0.3496 GiB: their capture reused what vLLM's profiling capture left
    # allocated. The same plan captured first took 1.1914 GiB; a reserve of 0.38 GiB stopped it.
    why = graph_budget(load_plan(PLAN), load_calibration(AFTER), LIVE)
    assert isinstance(why, str)
    assert "after vLLM's profiling pass" in why and "0.3496" in why and "--kv-cache-memory" in why


@pytest.mark.parametrize(
    "change, said",
    [
        ({"gpu": "NVIDIA H200"}, "gpu NVIDIA H100 80GB HBM3"),
        ({"vllm": "0.32.0"}, "vllm 0.33.0"),
        ({"torch": "2.14.0"}, "torch 2.11.0"),
        ({"lora_rank": 64}, "lora_rank 16"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size 1"),
        ({"shape": {**LIVE["shape"], "num_layers": 80}}, "num_layers 32"),
        ({"gpu": None}, "none known"),
        ({"attention_backend": "TRITON_ATTN"}, "attention backend FLASH_ATTN"),
    ],
)
def test_another_deployment_gets_vllms_own_estimate_and_the_reason(change, said):
    live = {k: v for k, v in {**LIVE, **change}.items() if v is not None}
    why = graph_budget(load_plan(PLAN), load_calibration(FIRST), live)
    assert isinstance(why, str) and said in why


def test_a_local_build_suffix_counts_only_where_both_sides_give_one():
    for torch in ("2.11.0", "2.11.0+cu130"):
        assert not isinstance(graph_budget(load_plan(PLAN), load_calibration(FIRST), {**LIVE, "torch": torch}), str)
    cal = load_calibration(FIRST)
    ident = cal.identity.model_copy(update={"torch": "2.11.0+cu130"})
    pinned = cal.model_copy(update={"identity": ident})
    assert isinstance(graph_budget(load_plan(PLAN), pinned, {**LIVE, "torch": "2.11.0+cu128"}), str)
    assert not isinstance(graph_budget(load_plan(PLAN), pinned, LIVE), str)


def test_another_plan_or_a_deferring_one_gets_no_reserve(tmp_path):
    other = load_plan(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml")
    why = graph_budget(other, load_calibration(FIRST), LIVE)
    assert isinstance(why, str) and "no start of this plan" in why
    plan = load_plan(PLAN)
    tiers = plan.model_copy(update={"tiers": object()})
    assert "deferred capture" in graph_budget(tiers, load_calibration(FIRST), LIVE)


def test_the_start_reports_say_whether_their_capture_followed_the_profiling_pass(tmp_path):
    assert read_report(RUN / "start4-apply.report.json").after_profiling is False
    assert read_report(ROOT / "tests/gpu/results/production/0.33.0-h100/start0-full.report.json").after_profiling
    old = json.loads((RUN / "start4-apply.report.json").read_text())
    del old["profiling_capture"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert read_report(tmp_path / "old.json").after_profiling is None  # an older runtime's: unknown
    cal = load_calibration(FIRST)
    unknown = cal.model_copy(update={"starts": [s.model_copy(update={"after_profiling": None}) for s in cal.starts]})
    assert "do not say" in graph_budget(load_plan(PLAN), unknown, LIVE)


# -- the engine side -------------------------------------------------------------------------------
def _ctx(plan, budget=None):
    return SimpleNamespace(
        plan=plan, plan_path=str(PLAN), release=RELEASES["0.33.0"], deferred=None,
        report=Report(plan, str(PLAN)), graph_budget=budget, capture_each=False,
    )  # fmt: skip


class _Runner:
    vllm_config = object()


def _fake_vllm_envs(monkeypatch, estimate: bool = True) -> None:
    """vLLM's `envs` module as the engine has it (vLLM is not installed here)."""
    import sys
    import types

    envs = types.ModuleType("vllm.envs")
    envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS = estimate
    package = sys.modules.get("vllm") or types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    monkeypatch.setattr(package, "envs", envs, raising=False)


def test_the_profiling_capture_is_answered_from_the_calibration(monkeypatch):
    _fake_vllm_envs(monkeypatch)
    plan = load_plan(PLAN)
    ctx = _ctx(plan)
    monkeypatch.setenv(CALIBRATION, str(FIRST))
    monkeypatch.delenv(MARGIN_ENV, raising=False)
    monkeypatch.setattr("capplan.runtime.report.deployment_identity", lambda cfg: LIVE)
    captured = []

    def profile_cudagraph_memory(self):  # vLLM's: a throwaway capture
        captured.append(self)
        return int(1.21 * GIB)

    hooked = memory._calibrated(ctx, memory.HOOKS[0], profile_cudagraph_memory)
    got = hooked(_Runner())
    assert captured == []  # vLLM's profiling capture skipped
    measured = math.ceil((1.1914 + 0.00005) * GIB)
    assert got == ctx.graph_budget.reserve_bytes == measured + default_margin_bytes(measured)
    assert ctx.report.to_json()["graph_budget"]["reserved_gib"] == round(got / GIB, 4)
    monkeypatch.setattr("capplan.runtime.report.deployment_identity", lambda cfg: {**LIVE, "gpu": "NVIDIA A100"})
    other = _ctx(plan)
    assert memory._calibrated(other, memory.HOOKS[0], profile_cudagraph_memory)(_Runner()) == int(1.21 * GIB)
    assert len(captured) == 1 and other.graph_budget is None
    assert "NVIDIA A100" in other.report.to_json()["graph_budget"]["why"]


def test_the_hook_applies_on_releases_that_profile_by_capture_and_records_vllm_s_estimate_without_one(monkeypatch):
    from capplan.runtime.hooking import Need
    from capplan.runtime.registry import selected

    plan = load_plan(PLAN)
    names = {h.name for h in selected(Need(RELEASES["0.33.0"], plan, {CALIBRATION: str(FIRST)}))}
    assert "memory.calibrated" in names
    assert "memory.calibrated" in {h.name for h in selected(Need(RELEASES["0.33.0"], plan, {}))}
    tiered = plan.model_copy(update={"tiers": object()})
    assert "memory.calibrated" not in {h.name for h in selected(Need(RELEASES["0.33.0"], tiered, {}))}
    # without a calibration vLLM's profiling pass runs and its estimate is recorded, not changed
    monkeypatch.delenv(CALIBRATION, raising=False)
    ran = []

    def profile_cudagraph_memory(self):
        ran.append(self)
        return int(1.21 * GIB)

    ctx = _ctx(plan)
    assert memory._calibrated(ctx, memory.HOOKS[0], profile_cudagraph_memory)(_Runner()) == int(1.21 * GIB)
    assert len(ran) == 1 and ctx.graph_budget is None and ctx.report.graph_budget is None
    assert ctx.report.to_json()["vllm_estimate_gib"] == 1.21
    assert "memory.calibrated" not in {
        h.name for h in selected(Need(RELEASES["0.28.0"], plan, {CALIBRATION: str(FIRST)}))
    }  # MRV2's profile_cudagraph_memory returns 0 there: there is no profiling capture to skip


class _Manager:
    def __init__(self, plan):
        self._capplan_plan = plan
        self._capture_mem_samples = None  # not vLLM's profiling capture
        self._capture_descs = {}
        self.graphs = {}


def _capture_with(monkeypatch, took_gib, budget):
    free = iter([80 * GIB, 80 * GIB - round(took_gib * GIB)])
    monkeypatch.setattr(report_module, "_free_memory", lambda: next(free))
    plan = load_plan(PLAN)
    ctx = _ctx(plan, budget)
    ctx.report.planned(len(plan.graphs))
    hook = manager_hooks.HOOKS[2].on(ctx.release)
    mgr = _Manager(plan)

    def capture(self):
        return "captured"

    return manager_hooks._capture(ctx, hook, capture)(mgr)


def test_a_capture_that_outgrows_what_was_left_stops_the_engine_before_serving(monkeypatch):
    budget = graph_budget(load_plan(PLAN), load_calibration(FIRST), LIVE)
    assert _capture_with(monkeypatch, 1.1914, budget) == "captured"
    assert _capture_with(monkeypatch, 5.0, None) == "captured"  # vLLM sized the KV cache: its own account
    with pytest.raises(memory.GraphMemoryOutgrown) as stop:
        _capture_with(monkeypatch, 1.40, budget)
    line = str(stop.value)
    assert "\n" not in line and line.startswith("capplan: the CUDA graphs took 1.4000 GiB")
    assert "1.1974 GiB left" in line and "1.1915 GiB measured" in line  # the reading's rounding, taken up
    assert outgrown(budget, budget.reserve_bytes) is None


def test_an_out_of_memory_capture_in_what_was_left_is_one_line(monkeypatch):
    monkeypatch.setattr(report_module, "_free_memory", lambda: None)
    plan = load_plan(PLAN)
    budget = graph_budget(plan, load_calibration(FIRST), LIVE)
    ctx = _ctx(plan, budget)

    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name
        pass

    def capture(self):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    with pytest.raises(memory.GraphMemoryOutgrown, match="ran out of GPU memory in the 1.1974 GiB"):
        manager_hooks._capture(ctx, manager_hooks.HOOKS[2].on(ctx.release), capture)(_Manager(plan))


# -- the launcher side -----------------------------------------------------------------------------
@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A Python that looks like vLLM's with capplan's plugin to the launcher, whose server prints
    its environment: the launcher itself must import no vLLM."""
    import capplan.launcher.vllm_cli as cli

    def no_parser(*args, **kwargs):
        raise AssertionError("the launcher ran vLLM's parser")

    monkeypatch.setattr(cli, "resolve_lines", no_parser)
    monkeypatch.setattr(cli, "run_script", no_parser)
    python = tmp_path / "python3"
    out = tmp_path / "env.json"
    python.write_text(
        "#!/bin/sh\n"
        'case "$2" in *importlib*) echo True True 0.33.0; exit 0;; esac\n'
        f"exec {os.sys.executable} -c \"import json, os; json.dump(dict(os.environ), open('{out}', 'w'))\"\n"
    )
    python.chmod(0o755)
    return python, out


def test_apply_runs_the_server_without_reading_its_command_itself(fake_vllm, tmp_path):
    python, out = fake_vllm
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "M", "--max-loras", "2"]
    result = runner.invoke(app, ["apply", "--runner", "mrv2", str(PLAN), "--calibration", str(FIRST), "--", *command])
    assert result.exit_code == 0, result.output
    env = json.loads(out.read_text())
    assert json.loads(env[COMMAND]) == command  # the server reads it, with vLLM's parser (a contradiction too)
    assert env[CALIBRATION] == str(FIRST.resolve()) and MARGIN_ENV not in env
    assert "2 start(s) of this plan, their capture run first, measured up to 1.1914 GiB" in result.output
    assert "leaves 1.1974 GiB (0.0060 GiB margin)" in result.output


def test_apply_says_where_the_calibration_cannot_size_the_kv_cache(fake_vllm):
    python, out = fake_vllm
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
    result = runner.invoke(app, ["apply", "--runner", "mrv2", str(PLAN), "--calibration", str(AFTER), "--", *command])
    assert result.exit_code == 0, result.output
    assert "after vLLM's profiling pass" in result.output and "vLLM's own profiling capture sizes" in result.output
    result = runner.invoke(
        app, ["apply", "--runner", "mrv2", str(PLAN), "--calibration", str(FIRST), "--graph-margin", "0.25",
              "--", *command]
    )  # fmt: skip
    assert result.exit_code == 0 and json.loads(out.read_text())[MARGIN_ENV] == "0.25"


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--graph-margin", "0.1"], "--graph-margin needs --calibration"),
        (["--calibration", "CAL", "--graph-margin", "-1"], "--graph-margin must be between 0 and 64"),
        (["--calibration", "CAL", "--graph-margin", "nan"], "--graph-margin must be between 0 and 64"),
        (["--calibration", "MISSING"], "MISSING"),
        (["--calibration", "BAD"], "BAD"),
    ],
)
def test_a_bad_calibration_or_margin_is_one_line_and_nothing_runs(fake_vllm, tmp_path, extra, said):
    python, out = fake_vllm
    (tmp_path / "bad.yaml").write_text("name: x\nstarts: [{report: r}]\n")
    swap = {"CAL": str(FIRST), "MISSING": str(tmp_path / "missing.yaml"), "BAD": str(tmp_path / "bad.yaml")}
    extra = [swap.get(e, e) for e in extra]
    said = swap.get(said, said)
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
    result = runner.invoke(app, ["apply", "--runner", "mrv2", str(PLAN), *extra, "--", *command])
    assert result.exit_code in (1, 2), result.output
    assert said in result.output and "Traceback" not in result.output
    assert not out.exists()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.lists(st.text(max_size=30), max_size=8).map(json.dumps)))
def test_the_command_the_launcher_passes_is_read_or_ignored_never_raises(text):
    command = command_of(text)
    assert command is None or (isinstance(command, list) and command and all(isinstance(a, str) for a in command))
    if command is not None:
        its_arguments(command, command[1:])


def test_only_the_server_the_command_starts_reads_it():
    command = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
    assert its_arguments(command, ["--model", "M"])
    assert not its_arguments(command, ["--model", "N"])
    assert its_arguments(["vllm", "serve", "M"], ["serve", "M"])
    assert not its_arguments(["python3", "script.py"], [])


def test_the_servers_parser_is_hooked_only_where_apply_passed_the_command():
    from capplan.runtime.hooking import Need
    from capplan.runtime.registry import selected

    plan = load_plan(PLAN)
    with_command = {h.name for h in selected(Need(RELEASES["0.25.0"], plan, {COMMAND: '["vllm", "serve", "M"]'}))}
    assert "config.launch_line" in with_command
    assert "config.launch_line" not in {h.name for h in selected(Need(RELEASES["0.33.0"], plan, {}))}


@pytest.mark.parametrize(
    "env, said",
    [
        ({MARGIN_ENV: "nan"}, "not between 0 and 64"),
        ({MARGIN_ENV: "-1"}, "not between 0 and 64"),
        ({MARGIN_ENV: "x"}, "could not be read"),
        ({"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0"),
        ({CALIBRATION: "/nonexistent/cal.yaml"}, "could not be read"),
    ],
)
def test_a_bad_value_in_the_engines_environment_leaves_vllm_in_charge(monkeypatch, env, said):
    _fake_vllm_envs(monkeypatch, estimate=env.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS") != "0")
    monkeypatch.setattr("capplan.runtime.report.deployment_identity", lambda cfg: LIVE)
    ctx = _ctx(load_plan(PLAN))
    why = memory.budget_for(ctx, object(), {CALIBRATION: str(FIRST), **env})
    assert isinstance(why, str) and said in why and "\n" not in why


def test_a_reserve_with_no_margin_is_never_below_the_reading_it_came_from():
    budget = graph_budget(load_plan(PLAN), load_calibration(FIRST), LIVE, 0.0)
    assert not isinstance(budget, str)
    assert budget.reserve_bytes >= 1.1914 * GIB and budget.reserve_bytes - 1.1914 * GIB <= 0.00005 * GIB + 1
    assert outgrown(budget, round(1.19144 * GIB)) is None  # the capture it was read from, to its rounding


def test_plans_with_graphs_the_reading_leaves_out_get_no_reserve():
    plan = load_plan(PLAN)
    spec = plan.spec.model_copy(
        update={"speculative": plan.spec.speculative.model_copy(update={"num_speculative_tokens": 2})}
    )
    why = graph_budget(plan.model_copy(update={"spec": spec}), load_calibration(FIRST), LIVE)
    assert isinstance(why, str) and "speculator or encoder graphs" in why
    why = graph_budget(plan.model_copy(update={"encoder": object()}), load_calibration(FIRST), LIVE)
    assert isinstance(why, str) and "speculator or encoder graphs" in why


@pytest.mark.parametrize("missing", ["gpu", "vllm", "torch"])
def test_a_calibration_that_does_not_say_its_gpu_or_releases_is_no_reserve(missing):
    cal = load_calibration(FIRST)
    blind = cal.model_copy(update={"identity": cal.identity.model_copy(update={missing: None})})
    why = graph_budget(load_plan(PLAN), blind, LIVE)
    assert isinstance(why, str) and f"records no {missing}" in why


def test_apply_takes_a_calibration_folder_as_the_engine_does(fake_vllm, tmp_path):
    python, out = fake_vllm
    folder = tmp_path / "cal"
    folder.mkdir()
    (folder / "first.yaml").write_text(FIRST.read_text())
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
    result = runner.invoke(app, ["apply", "--runner", "mrv2", str(PLAN), "--calibration", str(folder), "--", *command])
    assert result.exit_code == 0, result.output
    assert "measured up to 1.1914 GiB" in result.output
    assert json.loads(out.read_text())[CALIBRATION] == str(folder.resolve())


def test_capture_each_reads_every_graph_of_vllm_s_one_capture_between_one_graph_and_the_next(monkeypatch):
    """CAPPLAN_CAPTURE_EACH: vLLM's own capture, once (one stream, one pool); each graph's seconds
    and growth read as vLLM's loop takes the next graph, in the plan's order; the list put back."""
    free = iter([80 * GIB, 80 * GIB - GIB])
    monkeypatch.setattr(report_module, "_free_memory", lambda: next(free))
    plan = load_plan(PLAN)
    ctx = _ctx(plan)
    ctx.capture_each = True
    from collections import namedtuple

    mode, desc = namedtuple("Mode", "name"), namedtuple("Desc", "gid mode cg_mode num_active_loras")
    ctx.vllm_descs = [desc(i, g.descriptor.cg_mode, mode(g.descriptor.cg_mode), g.descriptor.num_active_loras)
                      for i, g in enumerate(plan.graphs)]  # fmt: skip
    ctx.report.planned(len(plan.graphs))
    mgr = _Manager(plan)
    for d in ctx.vllm_descs:
        mgr._capture_descs.setdefault(d.mode, []).append(d)
    kept = mgr._capture_descs
    taken = []

    def capture(self):  # vLLM's loop: PIECEWISE then FULL, each list walked once
        for mode in ("PIECEWISE", "FULL"):
            for d in self._capture_descs.get(mode, []):
                taken.append(d.gid)
        return "x"

    got = manager_hooks._capture(ctx, manager_hooks.HOOKS[2].on(ctx.release), capture)(mgr)
    assert got == "x" and taken == list(range(len(plan.graphs))) and mgr._capture_descs is kept
    rows = ctx.report.to_json()["captures"]
    assert [r["graph"] for r in rows] == taken
    g = plan.graphs[7].descriptor
    assert {k: rows[7][k] for k in ("graph", "cg_mode", "num_tokens", "lora_case", "bytes")} == {
        "graph": 7,
        "cg_mode": g.cg_mode,
        "num_tokens": g.num_tokens,
        "lora_case": g.num_active_loras,
        "bytes": 0,
    }
    assert all(r["seconds"] >= 0 for r in rows) and ctx.report.to_json()["graph_memory_gib"] == 1.0
    assert ctx.report.to_json()["graphs_captured"] == sum(1 for g in plan.graphs if g.descriptor.cg_mode == "PIECEWISE")
    plain = _ctx(plan)
    monkeypatch.setattr(report_module, "_free_memory", lambda: None)
    manager_hooks._capture(plain, manager_hooks.HOOKS[2].on(plain.release), lambda self: "y")(_Manager(plan))
    assert plain.report.to_json()["captures"] is None


def test_boundaries_report_each_item_once_the_loop_comes_back_for_the_next():
    seen = []
    marks = iter(range(100))
    b = manager_hooks.Boundaries(["a", "b", "c"], lambda item, before: seen.append((item, before)), lambda: next(marks))
    out = []
    for item in b:
        out.append((item, list(seen)))
    assert out == [("a", []), ("b", [("a", 0)]), ("c", [("a", 0), ("b", 1)])]
    assert seen == [("a", 0), ("b", 1), ("c", 2)] and b == ["a", "b", "c"] and b[:2] == ["a", "b"]
