"""Scaling a deployment's price to a changed plan, judged on plan pairs measured on the GPU.

The shipped H100 calibrations (`capplan/data/calibrations/h100-vllm033-*-probe.yaml`, rebuilt from
the kept reports by test_calibration_starts.py) hold, per deployment, a probe of plan A and
first-capture starts of plan B (and of A for two of them). Every figure the results README and
benchmarks quote is computed here from them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.calibration.price import (
    PairError,
    _within,
    error_band,
    fit_shape_model,
    plan_pair_errors,
    price_from_starts,
    project_calibrations,
)
from capplan.cli import app
from capplan.loading import load_calibration
from capplan.planfile import load_plan

ROOT = Path(__file__).resolve().parents[1]
README_BENCH = (ROOT / "docs" / "benchmarks.md").read_text()
RUN = ROOT / "tests" / "gpu" / "results" / "calibration" / "0.33.0-h100" / "probes"
README = (RUN / "README.md").read_text()


@pytest.fixture(scope="module")
def errors():
    """The pairs of the `probes/` run, as its README states them (the calibrations of that run)."""
    return plan_pair_errors([c for c in project_calibrations() if c.name.endswith("-probe")])


@pytest.fixture(scope="module")
def all_errors():
    """Every plan pair of the calibrations capplan ships: what a price's interval rests on."""
    return plan_pair_errors(project_calibrations())


def test_one_probe_prices_each_changed_plan_s_seconds_within_15_percent_and_memory_within_5(errors):
    assert len(errors.seconds) == 4 and len(errors.gib) == 4
    assert all(abs(e.error) < 0.15 for e in errors.seconds)
    assert all(abs(e.error) < 0.05 for e in errors.gib)
    for e in errors.seconds:
        assert f"{100 * e.error:+.1f}%" in README


def test_held_out_pairs_inside_the_interval_the_others_give_as_the_readme_counts(errors):
    def inside(errs):
        out = 0
        for i, e in enumerate(errs):
            lo, hi = error_band([x.error for j, x in enumerate(errs) if j != i])
            out += lo <= e.error <= hi
        return out

    assert inside(errors.seconds) == 3 and "3 of the 4\npairs lie inside" in README
    assert inside(errors.gib) == 4 and "each of the four lies\ninside" in README
    lo, hi = error_band([e.error for e in errors.seconds])
    assert f"is {100 * lo:.1f}% to +{100 * hi:.1f}%" in README.replace("\n", " ")


def test_every_shipped_pair_lies_inside_the_interval_the_others_give_as_the_benchmarks_count(all_errors):
    """Six seconds pairs on three H100 machines (five shapes), six memory pairs (three shapes: a
    pair repeated to the byte by another machine counts once)."""
    assert len(all_errors.seconds) == 6 and len(all_errors.gib) == 6
    assert all(abs(e.error) < 0.15 for e in all_errors.seconds) and all(abs(e.error) < 0.05 for e in all_errors.gib)
    doc = README_BENCH.replace("\n", " ")
    for what, errs in (("seconds", all_errors.seconds), ("memory", all_errors.gib)):
        held = [[x.error for j, x in enumerate(errs) if j != i] for i in range(len(errs))]
        inside = sum(error_band(h)[0] <= e.error <= error_band(h)[1] for e, h in zip(errs, held))
        assert inside == len(errs)
        lo, hi = error_band([e.error for e in errs])
        assert f"{what} {100 * lo:.1f}% to +{100 * hi:.1f}%" in doc, (what, lo, hi)
    assert "Held out, each of the 6 seconds pairs and each of the 6 memory pairs" in doc


def test_the_interval_is_where_the_truth_lies_given_the_error_band():
    errs = [0.02, -0.01, 0.03]
    lo_err, hi_err = error_band(errs)
    fig = _within(100.0, errs)
    # predicted / true - 1 in [lo_err, hi_err]  <=>  true in [100 / (1 + hi_err), 100 / (1 + lo_err)]
    assert fig.lo == pytest.approx(100 / (1 + hi_err)) and fig.hi == pytest.approx(100 / (1 + lo_err))
    assert _within(5.0, [0.1]) == _within(5.0, []) and _within(5.0, []).lo is None  # no band: none
    assert _within(5.0, []).text(".1f", "s") == "5.0 s (no interval)"
    assert error_band([0.0, 0.0]) == (0.0, 0.0)
    assert PairError("a", "b", 2.2, 2.0).error == pytest.approx(0.1)


def test_the_readme_example_is_what_diff_prints(tmp_path):
    runner = CliRunner()
    cal = tmp_path / "A.yaml"
    made = runner.invoke(app, ["calibrate-start", str(RUN / "llama-3.1-8b-startA.report.json"),
                               str(RUN / "llama-3.1-8b-probe.calibration.report.json"), "--plan",
                               str(RUN / "planA.plan.yaml"), "--model-config",
                               str(ROOT / "tests" / "gpu" / "configs" / "llama-3.1-8b.json"), "-o", str(cal)])  # fmt: skip
    assert made.exit_code == 0, made.output
    out = runner.invoke(app, ["diff", str(RUN / "planA.plan.yaml"), str(RUN / "planB.plan.yaml"), "--calibration",
                              str(cal)]).stdout  # fmt: skip
    said = re.search(
        r"\+238 graphs, \+25\.5 \[\+20\.3\.\.\+31\.4\] s capture, \+0\.967 \[\+0\.920\.\.\+1\.015\] GiB", out
    )
    assert said and said.group(0).replace("\n", " ") in README.replace("\n      ", " ").replace("\n", " ")
    shipped = load_calibration(RUN / "llama-3.1-8b-planA.calibration.yaml")
    assert [s.fingerprint for s in shipped.starts] == [s.fingerprint for s in load_calibration(cal).starts]


def test_the_changed_plan_s_measured_figures_lie_in_the_scaled_intervals():
    cal = load_calibration(RUN / "llama-3.1-8b-planA.calibration.yaml")
    priced = price_from_starts(load_plan(RUN / "planB.plan.yaml"), cal)
    assert priced is not None and priced.kind == "scaled"
    assert priced.seconds.lo <= 54.079 <= priced.seconds.hi and priced.gib.lo <= 2.1406 <= priced.gib.hi
    assert any("LoRA case 9 priced as case 5" in n for n in priced.notes)
    assert any("Intel(R) Xeon(R) Processor (16 cores)" in n for n in priced.notes)


def test_a_probe_report_of_format_1_prices_seconds_but_no_memory_and_no_reserve():
    """A format-1 probe captured each graph in a call of its own: 4.27x the memory at 8B."""
    from capplan.calibration.budget import plan_starts

    cal = load_calibration(RUN / "llama-3.1-8b-planA.calibration.yaml")
    probe = next(s for s in cal.starts if s.captures)
    assert probe.report_format == 1 and not probe.plan_memory and probe.graph_memory_gib > 4
    first, _ = plan_starts(load_plan(RUN / "planA.plan.yaml"), cal)
    assert [s.graph_memory_gib for s in first] == [1.1914]  # the start's, not the probe's
    alone = cal.model_copy(update={"starts": [probe]})
    assert price_from_starts(load_plan(RUN / "planB.plan.yaml"), alone) is None


def test_the_shape_model_memory_errors_are_not_one_sided_and_come_from_first_captures():
    model = fit_shape_model(project_calibrations())
    gib = model.gib_errors  # one per shape: two runs of one shape read the same growth
    assert len(gib) == 5 and min(gib) < 0 < max(gib) and max(abs(e) for e in gib) < 0.1
    assert {h.name for h in model.held_out if h.gib_error is None} == {
        "h100-vllm033-llama3.1-8b",
        "h200-vllm033-llama0.9b",
        "h200-vllm033-tiny-llama",
    }  # after profiling


def test_captures_in_any_report_below_format_2_are_per_call_whatever_it_says():
    cal = load_calibration(RUN / "llama-3.1-8b-planA.calibration.yaml")
    probe = next(s for s in cal.starts if s.captures)
    for fmt in (None, 0, 1):
        assert not probe.model_copy(update={"report_format": fmt}).plan_memory
    assert probe.model_copy(update={"report_format": 2}).plan_memory


def test_a_figure_scaled_another_way_than_the_pairs_measured_has_no_interval(tmp_path):
    runner = CliRunner()
    cal = tmp_path / "A.yaml"  # a start of A alone: no probe's per-capture seconds
    made = runner.invoke(app, ["calibrate-start", str(RUN / "llama-3.2-1b-startA.report.json"), "--plan",
                               str(RUN / "planA.plan.yaml"), "-o", str(cal)])  # fmt: skip
    assert made.exit_code == 0, made.output
    priced = price_from_starts(load_plan(RUN / "planB.plan.yaml"), load_calibration(cal))
    assert priced.seconds.lo is None and priced.seconds.hi is None
    assert "(no interval)" in priced.text()
    assert any("without a probe's per-capture seconds: no interval" in n for n in priced.notes)
    assert priced.gib.lo <= 1.1348 <= priced.gib.hi  # memory from a first-capture start: the pairs' way


def test_the_shape_model_s_intervals_hold_its_held_out_shapes():
    """Each held-out error against the 95% interval the other shapes' errors give (the interval a
    prediction of that shape would have carried): as docs/benchmarks.md states."""
    model = fit_shape_model(project_calibrations())
    inside = total = 0
    for h in model.held_out:
        others = [x.seconds_error for x in model.held_out if x.shape != h.shape]
        lo, hi = error_band(others)
        inside, total = inside + (lo <= h.seconds_error <= hi), total + 1
    gib = model.gib_errors
    g_inside = sum(error_band(gib[:i] + gib[i + 1 :])[0] <= e <= error_band(gib[:i] + gib[i + 1 :])[1]
                   for i, e in enumerate(gib))  # fmt: skip
    said = f"seconds {inside} of {total}, memory {g_inside} of {len(gib)}"
    assert said in README_BENCH.replace("\n", " "), said


def test_the_benchmarks_shape_model_example_is_what_diff_prints(tmp_path, monkeypatch):
    """docs/benchmarks.md's diff of an 8B deployment no calibration holds, priced by the shape model."""
    old = (
        'target: {runner: mrv2, vllm: "0.33.0", gpu: "NVIDIA H100 80GB HBM3"}\n'
        "scheduler: {max_num_seqs: 64, max_num_batched_tokens: 2048, max_model_len: 4096}\n"
        "cudagraph: {mode: FULL_AND_PIECEWISE}\n"
        "lora: {enabled: true, max_loras: 4, specialize: true, specialize_active: false}\n"
    )
    monkeypatch.chdir(tmp_path)
    Path("old.yaml").write_text(old)
    Path("new.yaml").write_text(
        old.replace("max_num_seqs: 64", "max_num_seqs: 48").replace("max_loras: 4", "max_loras: 6")
    )
    config = ROOT / "tests" / "gpu" / "configs" / "llama-3.1-8b.json"
    out = CliRunner().invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--model-config", str(config)])
    assert out.exit_code == 2, out.output  # a batch goes from a graph to eager: diff's REGRESSION exit
    lines = out.stdout.splitlines()
    head = [
        lines[0].split(": ", 1)[1],
        *[line for line in lines[1:12] if line.startswith("  ") and not line.startswith("  !")],
    ]
    head = [re.sub(r"calibration\(s\) \(.*\); worst", "calibration(s) (...); worst", line) for line in head]
    for line in head:
        assert (
            f"    {line.strip() if line.startswith('  ') else line}" in README_BENCH
            or f"      {line.strip()}" in README_BENCH
        ), line
