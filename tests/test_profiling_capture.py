"""vLLM's memory-profiling capture (0.29+) is counted apart from the real capture in the report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from capplan.planfile import load_plan
from capplan.present.report import render_report
from capplan.releases import RELEASES
from capplan.runtime import registry
from capplan.runtime.hooks.manager import PROFILING_MARK
from capplan.runtime.report import Report

PLAN = Path(__file__).resolve().parents[1] / "examples" / "qwen3-8b-multilora.plan.yaml"


class Mode(Enum):
    FULL = 2
    PIECEWISE = 1


@dataclass(frozen=True)
class Desc:
    cg_mode: Mode
    num_tokens: int
    num_active_loras: int


class Manager:
    """What the report reads off vLLM's manager after a capture call."""

    def __init__(self, descs: list[Desc], full_sample: int | None) -> None:
        self._capture_descs: dict = {}
        for d in descs:
            self._capture_descs.setdefault(d.cg_mode, []).append(d)
        full = self._capture_descs.get(Mode.FULL, [])
        self.graphs = {d: object() for d in (full if full_sample is None else full[:full_sample])}


def plan_descs(plan) -> list[Desc]:
    return [
        Desc(Mode[g.descriptor.cg_mode], g.descriptor.num_tokens, g.descriptor.num_active_loras) for g in plan.graphs
    ]


def test_profiling_graphs_are_reported_apart_and_the_real_capture_counts_each_graph_once():
    plan = load_plan(PLAN)
    descs = plan_descs(plan)
    modes = Counter(d.cg_mode.name for d in descs)
    assert modes["FULL"] > 3 and modes["PIECEWISE"] > 0
    report = Report(plan, str(PLAN))
    report.planned(len(descs) + 12)
    report.profiling_started()
    report.profiling_finished(Manager(descs, full_sample=3))  # vLLM samples the largest FULL graphs
    report.capture_started()
    report.capture_finished(Manager(descs, full_sample=None))
    data = report.to_json()
    report._finished = True
    assert data["graphs_captured"] == data["graphs_planned"] == len(descs)
    assert data["profiling_capture"]["graphs"] == 3 + modes["PIECEWISE"]
    assert data["profiling_capture"]["by_mode"] == {"FULL": 3, "PIECEWISE": modes["PIECEWISE"]}
    text = render_report(data)
    assert f"memory profiling first captured {3 + modes['PIECEWISE']} of the plan's graphs" in text
    assert f"graphs: {len(descs)}/{len(descs)} captured" in text


def test_a_release_without_profiling_capture_reports_none():
    report = Report(load_plan(PLAN), str(PLAN))
    report.planned(1)
    report._finished = True
    assert report.to_json()["profiling_capture"] is None
    assert "memory profiling" not in render_report(report.to_json())


def test_the_capture_hook_reads_the_profiling_mark_only_where_the_release_has_it():
    for release in RELEASES.values():
        (capture,) = [h for h in registry.entries(release) if h.name == "manager.capture"]
        assert (PROFILING_MARK in capture.attributes) == release.profiling_capture
    assert [v for v, r in RELEASES.items() if r.profiling_capture] == ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


def test_the_report_flusher_outlives_a_failed_refresh(tmp_path, monkeypatch, capsys):
    """A refresh that raises (anything, not only a counter resized mid-copy) is said once on
    stderr and retried: the file keeps up with the engine."""
    import json
    import time

    out = tmp_path / "report.json"
    monkeypatch.setenv("CAPPLAN_REPORT", str(out))
    plan = load_plan(PLAN)
    report = Report(plan, str(PLAN))
    report.planned(1)
    real, failures = report.write, []

    def flaky() -> None:
        if len(failures) < 2 and report._flusher is not None:
            failures.append(1)
            raise ValueError("simulated")
        real()

    report.capture_started()
    report.capture_finished(Manager(plan_descs(plan), None))
    monkeypatch.setattr(report, "write", flaky)
    try:
        for _ in range(3):
            report.eager += 1
            report._dirty = True
            time.sleep(1.2)
        deadline = time.monotonic() + 5
        while json.loads(out.read_text())["dispatch"]["eager"] != 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert json.loads(out.read_text())["dispatch"]["eager"] == 3
    finally:
        report._finished = True
    err = capsys.readouterr().err
    assert err.count("the report could not be refreshed (ValueError: simulated)") == 1
