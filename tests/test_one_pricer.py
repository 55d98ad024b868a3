"""One pricer: the same plan and the same evidence get the same price from every command that
prices it (show, diff, flags, simulate, optimize), whether the calibration is given with
--calibration or found in a `.capplan/calibration` folder beside the plans."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.calibration.price import Figure, Priced, PriceDelta, Pricer, load_pricer
from capplan.cli import app
from capplan.planfile import load_plan

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "gpu" / "results" / "calibration" / "0.33.0-h100" / "probes"
CAL = RUN / "llama-3.1-8b-planA.calibration.yaml"  # the 8B's probe and start of plan A, on an H100
runner = CliRunner()


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    """Plans A and B and plan B's spec, in a folder of their own."""
    monkeypatch.chdir(tmp_path)
    for name in ("planA.plan.yaml", "planB.plan.yaml", "planB.yaml"):
        shutil.copy(RUN / name, name)
    Path("t.jsonl").write_text(
        "".join(f'{{"num_reqs": {n}, "num_tokens": {n}, "max_query_len": 1}}\n' for n in (1, 7, 30))
    )
    return tmp_path


def _prices(calibration: list[str]) -> dict[str, dict]:
    show = json.loads(runner.invoke(app, ["show", "planB.plan.yaml", "--json", *calibration]).stdout)["price"]
    diff = runner.invoke(app, ["diff", "planA.plan.yaml", "planB.plan.yaml", "--format", "json", *calibration])
    simulate = runner.invoke(app, ["simulate", "planB.plan.yaml", "t.jsonl", "--json", *calibration])
    return {
        "show": show,
        "diff": json.loads(diff.stdout)["price"]["new"],
        "simulate": json.loads(simulate.stdout)["price"],
    }


def test_every_command_gives_the_same_price_given_or_found(deployment):
    given = _prices(["--calibration", str(CAL)])
    assert given["show"]["kind"] == "scaled" and given["show"]["capture_seconds"]["lo"] is not None
    assert given["diff"] == given["show"] == given["simulate"]
    flags = runner.invoke(app, ["flags", "planB.plan.yaml", "--calibration", str(CAL)])
    assert f"# (scaled; {given['show']['basis']})" in flags.stderr.splitlines()
    # optimize's default point is plan B itself: priced as show prices it
    optimized = runner.invoke(app, ["optimize", "planB.yaml", "t.jsonl", "--max-graphs", "100000", "--json",
                                    "--calibration", str(CAL), "-o", "out.yaml"])  # fmt: skip
    assert optimized.exit_code == 0, optimized.output
    default = json.loads(optimized.stdout)["default"]
    assert default["graph_memory_gib"] == given["show"]["graph_memory_gib"]["value"]
    assert default["capture_seconds"] == given["show"]["capture_seconds"]["value"]
    # the same calibration found beside the plans: the same price (its name is the folder's)
    Path(".capplan/calibration").mkdir(parents=True)
    shutil.copy(CAL, ".capplan/calibration/a.yaml")
    found = _prices([])
    for way in ("show", "diff", "simulate"):
        assert {k: v for k, v in found[way].items() if k != "basis"} == {
            k: v for k, v in given["show"].items() if k != "basis"
        }, way


def test_without_evidence_every_command_says_not_priced_and_what_would_price_it(deployment):
    prices = _prices([])
    for way, price in prices.items():
        assert price["kind"] == "not priced" and price["capture_seconds"] is None, way
        assert "capplan calibrate PLAN --model CONFIG.json" in price["basis"], way
    text = runner.invoke(app, ["simulate", "planB.plan.yaml", "t.jsonl"]).stdout
    assert "  capture: 496 graphs; capture time and graph memory not priced (no probe or start" in text


def test_a_folder_that_does_not_load_prices_nothing_and_says_so(deployment):
    Path(".capplan/calibration").mkdir(parents=True)
    Path(".capplan/calibration/bad.yaml").write_text("not: [a calibration")
    show = runner.invoke(app, ["show", "planB.plan.yaml"])
    assert show.exit_code == 0 and "calibration folder not read, so it prices nothing:" in show.stdout
    flags = runner.invoke(app, ["flags", "planB.plan.yaml"])
    assert flags.exit_code == 0 and "calibration folder not read" in flags.stderr
    given = runner.invoke(app, ["show", "planB.plan.yaml", "--calibration", ".capplan/calibration/bad.yaml"])
    assert given.exit_code == 1 and "bad.yaml" in given.stderr  # named by the operator: refused


def test_a_delta_has_an_interval_only_where_both_sides_have_one():
    plan = load_plan(RUN / "planB.plan.yaml")
    a = Priced(1, Figure(10.0, 9.0, 11.0), Figure(1.0, 1.0, 1.0), "scaled", "x")
    b = Priced(2, Figure(20.0), Figure(2.0, 1.5, 2.5), "scaled", "y")
    none = Priced(2, None, None, "not priced", "z")
    d = PriceDelta(a, b)
    assert d.seconds == Figure(10.0) and d.gib == Figure(1.0, 0.5, 1.5) and d.graphs == 1
    assert PriceDelta(a, none).seconds is None and not PriceDelta(a, none).priced
    # one source errs alike on both plans: bound by bound; two sources: the widest both allow
    c = Priced(2, Figure(30.0, 25.0, 40.0), None, "scaled", "y")
    assert PriceDelta(a, c).seconds == Figure(20.0, 14.0, 31.0)
    one = PriceDelta(dataclasses.replace(a, source="s"), dataclasses.replace(c, source="s"))
    assert one.seconds == Figure(20.0, 16.0, 29.0)
    assert Figure(3.0, 3.0, 3.0).text(".1f", "s") == "3.0 s" and Figure(3.0).text(".1f", "s") == "3.0 s (no interval)"
    # no evidence and no shape: not priced; no graphs: exact zero, whatever the evidence
    assert Pricer().price(plan).kind == "not priced"
    empty = load_plan(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml")
    nothing = empty.model_copy(update={"graphs": []})
    assert load_pricer().price(nothing).kind == "exact" and load_pricer().price(nothing).seconds == Figure(0, 0, 0)


def test_a_plan_with_no_graphs_is_priced_exactly_and_its_diff_says_each_side(deployment):
    """No graphs: an exact zero, no graph memory to leave free; against a plan not priced, the
    markdown table shows the priced side and says the other is not."""
    Path("none.yaml").write_text(Path("planB.yaml").read_text().replace("FULL_AND_PIECEWISE", "NONE"))
    assert runner.invoke(app, ["compile", "none.yaml"]).exit_code == 0
    show = runner.invoke(app, ["show", "none.plan.yaml", "--calibration", str(CAL)])
    assert "no graphs: no graph memory to leave free beside the KV cache" in show.stdout
    md = runner.invoke(app, ["diff", "none.plan.yaml", "planB.plan.yaml", "--format", "markdown"]).stdout
    assert "| capture time (exact / not priced) | 0.0 s | not priced | - |" in md, md
    text = runner.invoke(app, ["diff", "none.plan.yaml", "planB.plan.yaml"]).stdout
    assert "  old basis: no graphs to capture" in text and "  new not priced: no probe or start" in text, text
