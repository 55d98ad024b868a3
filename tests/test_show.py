"""`capplan show`: one screen by default, every table with --full, the same with --plot."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app
from capplan.planfile.read import load_plan
from capplan.planner.capture_sizes import compact
from capplan.present.show import render_show

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.plan.yaml"))
QWEN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
runner = CliRunner()


def test_compact_sizes():
    assert compact([1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]) == "1, 2, 4, 8..256 step 8, 272..512 step 16"
    assert compact([3, 6, 9, 18]) == "3..9 step 3, 18"
    assert compact([5, 1, 2, 3]) == "1..3, 5"
    assert compact([]) == "none"


@pytest.mark.parametrize("plan", EXAMPLES, ids=lambda p: p.name)
def test_show_is_one_screen_and_full_is_every_table(plan):
    short = runner.invoke(app, ["show", str(plan)])
    assert short.exit_code == 0, short.output
    assert len(short.stdout.splitlines()) <= 60, short.stdout
    full = runner.invoke(app, ["show", str(plan), "--full"])
    loaded = load_plan(plan)
    from capplan.commands.inspect import show
    from capplan.present.show import price_lines

    # Priced (with an interval) where the spec gives the model's shape, else not priced and why.
    shown = show(plan)
    assert full.stdout == render_show(loaded, str(plan), "\n  ".join(price_lines(shown.priced)))
    assert len(full.stdout.splitlines()) > len(short.stdout.splitlines())


def test_show_names_sizes_counts_eager_ranges_and_fixes_per_mode_and_case():
    out = runner.invoke(app, ["show", str(QWEN)]).stdout
    lines = out.splitlines()
    assert len(lines) <= 60
    assert "Capture sizes (51, max 512): 1, 2, 4, 8..256 step 8, 272..512 step 16" in lines
    assert any(line.split()[:5] == ["PIECEWISE", "9", "47", "16..256", "step"] for line in lines), out
    assert any(line.split()[:5] == ["FULL", "0,", "1", "35", "1,"] for line in lines), out
    assert "total: 496 graphs" in lines
    assert "  all batches of 513..8192 tokens run eager (above the largest graph)" in lines
    assert "  prune_unreachable: 9 change(s) to capture" in lines
    assert "Token ranges" not in out  # the per-case tables are --full's


def test_plot_prints_the_short_form_and_json_is_unchanged(tmp_path):
    short = runner.invoke(app, ["show", str(QWEN)]).stdout
    plotted = runner.invoke(app, ["show", str(QWEN), "--plot", str(tmp_path / "p.svg")])
    assert plotted.exit_code == 0 and plotted.stdout == short
    data = json.loads(runner.invoke(app, ["show", str(QWEN), "--json"]).stdout)
    assert len(data["descriptors"]) == 496 and data["price"]["kind"] == "not priced"


def test_no_dp_paragraph_at_dp_1_and_one_under_dp():
    from pathlib import Path

    from typer.testing import CliRunner

    from capplan.cli import app

    root = Path(__file__).resolve().parents[1]
    runner = CliRunner()
    for full in ([], ["--full"]):
        single = runner.invoke(app, ["show", str(root / "examples" / "qwen3-8b-multilora.plan.yaml"), *full])
        assert single.exit_code == 0 and "DP: " not in single.stdout  # no other rank to sync with
        dp2 = runner.invoke(app, ["show", str(root / "examples" / "mixtral-dp2-lora.plan.yaml"), *full])
        assert dp2.stdout.count("DP: size 2; ranks all-reduce num_tokens") == 1
