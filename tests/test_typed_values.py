"""Values of one type where another was meant, each pinned by a test that fails on such code:
a graph's name reused for an integer in the optimizer's knapsack and in the lora_slot
deviations, a str handed to load_plan by the plugin, and the report's flusher thread kept in
an attribute typed None."""

import threading
import typing
from pathlib import Path

import pytest

from capplan.errors import EngineRefusal, UnsupportedVllm
from capplan.planner import compile_plan
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"


def test_the_optimizer_knapsack_keeps_graphs_and_counts_apart():
    """The per-case knapsack once unpacked graph counts into the name of the loop's graph
    (`g`): harmless at run time (the graph was no longer read), and what mypy, which
    CI runs, reported. The module must type-check on its own."""
    api = pytest.importorskip("mypy.api")
    out, err, code = api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            "/dev/null",
            "--follow-imports=silent",
            str(ROOT / "src" / "capplan" / "traffic" / "optimize.py"),
        ]
    )
    assert code == 0, out + err


def test_lora_slot_lists_grid_changes_where_vllm_recorded_no_grid():
    """The lora_slot deviations sorted (case, grid before, grid after) keys in which a grid
    can be None, next to keys of the same case with a grid: a TypeError before the fix."""
    from capplan.planner.deviations import ExactTwin, _lora_slot

    spec = make_spec(
        cudagraph={"capture_sizes": [1, 2, 4, 8]},
        lora={"enabled": True, "max_loras": 4, "specialize": True, "specialize_active": True},
    )
    plan = compile_plan(spec)
    top = [g for g in plan.graphs if g.descriptor.num_active_loras > spec.lora.max_loras]
    assert len(top) > 1 and all(g.dummy.kernel_grid is not None for g in top)
    exact = ExactTwin(plan, ranges=None)
    vllm = exact.dummy

    def dummy(graph):  # vLLM's own dummy: the first graph of the case recorded no grid, the rest grid 1
        return vllm(graph).model_copy(update={"kernel_grid": None if graph is top[0] else 1})

    exact.dummy = dummy  # type: ignore[method-assign]
    grids = [line for line in _lora_slot(plan, exact) if "kernel grid" in line]
    case, after = spec.lora.max_loras + 1, top[0].dummy.kernel_grid
    assert grids == [
        f"capture: 1 graph(s) of LoRA case {case} get a -1 dummy row: kernel grid None -> {after}",
        f"capture: {len(top) - 1} graph(s) of LoRA case {case} get a -1 dummy row: kernel grid 1 -> {after}",
    ]


@pytest.fixture
def plugin(monkeypatch):
    """The plugin with CAPPLAN_PLAN naming an example plan, and install() recorded, not run."""
    import capplan.planfile
    import capplan.runtime.registry as registry
    from capplan.runtime import plugin

    calls: dict[str, list] = {"load_plan": [], "install": []}
    load_plan = capplan.planfile.load_plan
    monkeypatch.setattr(capplan.planfile, "load_plan", lambda p: calls["load_plan"].append(p) or load_plan(p))
    monkeypatch.setattr(registry, "install", lambda plan, path: calls["install"].append((plan, path)))
    monkeypatch.setenv("CAPPLAN_PLAN", str(PLAN))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return plugin, calls


def test_the_plugin_loads_the_plan_it_is_given_as_a_path(plugin):
    """The environment gives a str; load_plan is typed for a Path and now gets one."""
    module, calls = plugin
    module.register()
    [path] = calls["load_plan"]
    assert isinstance(path, Path) and path == PLAN
    [(plan, named)] = calls["install"]
    assert named == str(PLAN) and len(plan.graphs) > 0


@pytest.mark.parametrize(
    "error, line",
    [
        (UnsupportedVllm("capplan: vLLM 0.1 is not supported; supported: ..."), "capplan: vLLM 0.1 is not supported"),
        (EngineRefusal("capplan: p.plan.yaml does not match this engine"), "capplan: p.plan.yaml does not match"),
        (RuntimeError("CUDA driver too old"), "capplan: CUDA driver too old"),
    ],
)
def test_the_plugin_stops_the_engine_with_one_line_by_the_refusal_type(plugin, monkeypatch, error, line):
    import capplan.runtime.registry as registry

    module, _ = plugin

    def refuse(plan, path):
        raise error

    monkeypatch.setattr(registry, "install", refuse)
    with pytest.raises(SystemExit) as stopped:
        module.register()
    assert str(stopped.value.code).startswith(line)
    assert not str(stopped.value.code).startswith("capplan: capplan")


def test_the_contract_refusal_stops_the_engine_with_its_own_line(plugin, monkeypatch):
    import capplan.runtime.registry as registry
    from capplan.runtime.hooking import IncompatibleVllm

    module, _ = plugin

    def refuse(plan, path):
        raise IncompatibleVllm("capplan: vLLM's X has no y; this vLLM is not supported")

    monkeypatch.setattr(registry, "install", refuse)
    with pytest.raises(SystemExit) as stopped:
        module.register()
    assert stopped.value.code == "capplan: vLLM's X has no y; this vLLM is not supported"


class _Manager:
    """What the report reads off vLLM's CUDA-graph manager after capture."""

    def __init__(self) -> None:
        self._capture_descs: dict = {}
        self.graphs: dict = {}


def test_the_report_flusher_is_a_thread_started_once(tmp_path, monkeypatch):
    """The attribute holding the flusher was typed None and assigned a Thread."""
    from capplan.planfile import load_plan
    from capplan.runtime.report import Report

    assert typing.get_type_hints(Report)["_flusher"] == (threading.Thread | None)
    out = tmp_path / "report.json"
    monkeypatch.setenv("CAPPLAN_REPORT", str(out))
    report = Report(load_plan(PLAN), str(PLAN))
    report.planned(7)
    try:
        report.capture_started()
        report.capture_finished(_Manager())
        flusher = report._flusher
        assert isinstance(flusher, threading.Thread) and flusher.is_alive()
        report.capture_finished(_Manager())  # a second capture (another runner) keeps the one flusher
        assert report._flusher is flusher
        assert out.read_text().startswith('{\n  "plan": ')
    finally:
        report.finish()
    flusher.join(timeout=3)
    assert not flusher.is_alive()
