"""Pictures of odd inputs: a plan with no graphs, an all-eager trace, names that matplotlib
would read as TeX math. Each is drawn (SVG and PNG) or refused in one line; never a traceback."""

import json

import pytest
from typer.testing import CliRunner

from capplan.cli import app

runner = CliRunner()
pytest.importorskip("matplotlib")  # in capplan[test]


@pytest.fixture
def odd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e$x$.yaml").write_text("cudagraph: {mode: NONE}\n")
    (tmp_path / "q$\\frac{a}{$.yaml").write_text("scheduler: {max_num_seqs: 16, max_num_batched_tokens: 256}\n")
    for spec in ("e$x$.yaml", "q$\\frac{a}{$.yaml"):
        assert runner.invoke(app, ["compile", spec]).exit_code == 0
    (tmp_path / "t$_{x}$.jsonl").write_text(json.dumps({"num_reqs": 4, "num_tokens": 200, "max_query_len": 60}) + "\n")
    return tmp_path


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_pictures_of_empty_and_odd_inputs(odd, suffix):
    for plan in ("e$x$.plan.yaml", "q$\\frac{a}{$.plan.yaml"):
        shown = runner.invoke(app, ["show", plan, "--plot", f"show{suffix}"])
        assert shown.exit_code == 0, shown.output
        simulated = runner.invoke(app, ["simulate", plan, "t$_{x}$.jsonl", "--plot", f"sim{suffix}"])
        assert simulated.exit_code == 0, simulated.output
        assert (odd / f"show{suffix}").stat().st_size > 0 and (odd / f"sim{suffix}").stat().st_size > 0
    diffed = runner.invoke(app, ["diff", "e$x$.plan.yaml", "q$\\frac{a}{$.plan.yaml", "--plot", f"diff{suffix}"])
    assert diffed.exit_code == 2, diffed.output
    optimized = runner.invoke(
        app, ["optimize", "q$\\frac{a}{$.yaml", "t$_{x}$.jsonl", "--max-graphs", "20", "--plot", f"opt{suffix}"]
    )
    assert optimized.exit_code in (0, 2) and optimized.exception is None or isinstance(optimized.exception, SystemExit)
