"""The held-out round's judge (tests/gpu/price_heldout.py) and the predictions it judges against."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capplan.calibration.price import error_band, plan_pair_errors, project_calibrations

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "gpu" / "results" / "calibration" / "0.33.0-h100"
PREDICTIONS = RESULTS / "heldout" / "predictions.json"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from price_heldout import judge  # noqa: E402


def _before() -> list:
    names = json.loads(PREDICTIONS.read_text())["calibrations"]
    cals = [c for c in project_calibrations() if c.name in names]
    assert len(cals) == len(names)  # every calibration the predictions rest on is still in the project
    return cals


def test_the_pair_band_written_before_the_round_comes_from_the_calibrations_it_names():
    pred = json.loads(PREDICTIONS.read_text())
    pairs = plan_pair_errors(_before())
    for what, errs in (("seconds", pairs.seconds), ("gib", pairs.gib)):
        written = pred["pair_band"][what]
        assert [p["error"] for p in written["pairs"]] == pytest.approx([e.error for e in errs], abs=1e-12)
        assert written["band"] == pytest.approx(error_band([e.error for e in errs]), abs=1e-12)


@pytest.fixture(scope="module")
def judged_earlier_round(tmp_path_factory) -> list:
    """The judge on the round measured before the predictions (probes/), as if it were the round."""
    folder = tmp_path_factory.mktemp("round")
    for f in (RESULTS / "probes").iterdir():
        if f.name.endswith(".report.json") or f.name.endswith(".plan.yaml"):
            shutil.copy(f, folder)
    shutil.copy(PREDICTIONS, folder)
    return judge(folder)


def test_the_judge_prices_each_pair_as_the_price_model_does(judged_earlier_round):
    pred = json.loads(PREDICTIONS.read_text())
    pairs = [j for j in judged_earlier_round if j.basis == "pair"]
    # the 8B (probe, start A, start B) and the 14B (probe, start B) of that round; its 1B and MoE
    # shapes are not in the held-out round
    got = {(j.shape, j.what, j.plan): j for j in pairs}
    assert set(got) == {("llama-3.1-8b", "seconds", "B"), ("llama-3.1-8b", "gib", "A"),
                        ("llama-3.1-8b", "gib", "B"), ("qwen2.5-14b", "seconds", "B")}  # fmt: skip
    # the same errors as the project's pairs of those calibrations (the 14B has no memory pair: its
    # probe's memory is not a plan's)
    written = {p["calibration"]: p["error"] for p in pred["pair_band"]["seconds"]["pairs"]}
    assert got["llama-3.1-8b", "seconds", "B"].error == pytest.approx(written["h100-vllm033-llama3.1-8b-probe"])
    assert got["qwen2.5-14b", "seconds", "B"].error == pytest.approx(written["h100-vllm033-qwen2.5-14b-probe"])
    for j in pairs:
        lo, hi = pred["pair_band"][j.what]["band"]
        # the interval is the band around the prediction: the truth is inside iff the error is in the band
        assert j.inside == (lo <= j.error <= hi) or abs(j.error - lo) < 1e-9 or abs(j.error - hi) < 1e-9
        assert j.lo < j.predicted < j.hi


def test_the_judge_prints_one_line_a_figure_of_the_round():
    folder = RESULTS / "heldout"
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "price_heldout.py"), str(folder)],
                         capture_output=True, text=True)  # fmt: skip
    if not (folder / "planA.plan.yaml").exists():
        assert (out.returncode, out.stderr) == (
            1,
            f"{folder}: no round here (probe_bench.py's planA.plan.yaml and reports)\n",
        )
        return
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    judged = [line for line in lines if "not measured" not in line]
    assert len(judged) == len(judge(folder))
    assert all((" inside" in line) != (" OUTSIDE" in line) for line in judged)
    readme = (folder / "README.md").read_text()
    assert all(f"    {line}\n" in readme for line in lines)  # the round's README quotes the judge as it prints
    inside = sum(" inside" in line for line in judged)
    assert f"{inside} of the {len(judged)} figures measured lie inside" in readme.replace("\n", " ")
    # every shape the predictions priced and the round ran no job of is said
    assert any(line.startswith("llama-3.2-3b") and "not measured" in line for line in lines)
