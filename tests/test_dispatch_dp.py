"""`capplan dispatch --dp-ranks`: what this rank replays once vLLM's DP sync has padded the
step to the other ranks' batches (the simulator's DP sync, one rule for both)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.cli import app
from capplan.planfile.read import load_plan
from capplan.planner import Batch
from capplan.traffic.simulate import TraceBatch, simulate_ranks

ROOT = Path(__file__).resolve().parents[1]
DP2 = ROOT / "examples" / "mixtral-dp2-lora.plan.yaml"  # MoE, DP 2: ranks pad to one another
DP1 = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
runner = CliRunner()


def _ask(*args: str):
    return runner.invoke(app, ["dispatch", str(DP2), "--reqs", "3", "--tokens", "3", "--loras", "1", *args])


def test_a_larger_rank_pads_this_one_to_its_tokens():
    alone = json.loads(_ask("--json").stdout)
    synced = json.loads(_ask("--dp-ranks", "40x40", "--json").stdout)
    assert alone["num_tokens"] < 40 <= synced["num_tokens"]
    text = _ask("--dp-ranks", "40x40").stdout
    assert "with DP sync over 2 ranks (this one first; tokens 3, 40): every rank pads to 40 tokens" in text


def test_a_rank_that_would_run_eager_makes_this_one_eager():
    result = _ask("--dp-ranks", "60x3000")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("eager") and "every rank runs eager" in result.stdout


@settings(max_examples=40, deadline=None)
@given(
    mine=st.tuples(st.integers(1, 64), st.integers(0, 300), st.integers(0, 4)),
    other=st.one_of(st.none(), st.tuples(st.integers(1, 64), st.integers(0, 300))),
)
def test_the_answer_is_the_simulators_dp_sync(mine, other):
    reqs, extra, loras = mine
    loras = min(loras, reqs)
    tokens = reqs + extra
    entry = "idle" if other is None else f"{other[0]}x{other[0] + other[1]}"
    result = runner.invoke(
        app,
        ["dispatch", str(DP2), "--reqs", str(reqs), "--tokens", str(tokens), "--loras", str(loras),
         "--dp-ranks", entry, "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_plan(DP2)
    this = Batch(reqs, tokens, -(-tokens // reqs), loras)
    that = None if other is None else Batch(other[0], other[0] + other[1], -(-(other[0] + other[1]) // other[0]))
    traces = [[TraceBatch(this, 1, 0)], [] if that is None else [TraceBatch(that, 1, 0)]]
    sim = simulate_ranks(plan, traces)
    [hit] = sim.ranks[0].hits or [-1]
    answer = json.loads(result.stdout)
    if hit < 0:
        assert answer["cg_mode"] == "NONE"
    else:
        desc = plan.graphs[hit].descriptor
        assert (answer["cg_mode"], answer["num_tokens"], answer["num_active_loras"]) == (
            desc.cg_mode,
            desc.num_tokens,
            desc.num_active_loras,
        )


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=30))
def test_bad_dp_ranks_are_one_line(text):
    result = _ask("--dp-ranks", text)
    assert "Traceback" not in result.output
    if result.exit_code != 0:
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "--dp-ranks" in result.stderr


def test_dp_ranks_refused_where_ranks_do_not_sync_and_when_counted_wrong():
    one = runner.invoke(app, ["dispatch", str(DP1), "--reqs", "3", "--tokens", "3", "--dp-ranks", "5"])
    assert one.exit_code == 2 and "never pad to one another" in one.stderr
    many = _ask("--dp-ranks", "5,6")
    assert many.exit_code == 2 and "give the other 1 rank(s)' batches" in many.stderr
