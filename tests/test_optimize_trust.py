"""optimize and simulate never price a step on data the calibration does not have.

The case that made this necessary: a trace of 256-token decode steps (256 requests, 4
adapters and base requests: LoRA case 5) and a calibration holding one FULL replay
(256 tokens, case 5) and three eager times. The old step model extrapolated and let a
mode stand in for another, so optimize chose one PIECEWISE size of 512 and predicted no
loss; served, it ran at 0.30-0.39x of the default plan.
"""

import json

import pytest
import yaml
from typer.testing import CliRunner

from capplan.cli import app
from capplan.errors import UsageError
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.schemas.calibration import Calibration, StepTime
from capplan.traffic.optimize import optimize
from capplan.traffic.simulate import TraceBatch, simulate
from capplan.traffic.steps import step_times
from tests.conftest import make_spec

runner = CliRunner()
SPEC = dict(
    target={"vllm": "0.25"},
    scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048},
    lora={"enabled": True, "max_loras": 4, "specialize_active": True},
)
DECODE_256 = TraceBatch(Batch(256, 256, 1, 4, True), 1000)  # case 5 under lora_slot
EAGER = [StepTime(mode="eager", case=5, tokens=t, ms=ms) for t, ms in ((64, 9.0), (512, 14.0), (4096, 60.0))]


def _cost(*graph_rows: tuple[str, int, int, float]):
    rows = [StepTime(mode=m, case=c, tokens=t, ms=ms) for m, c, t, ms in graph_rows] + EAGER
    return step_times(Calibration(name="one-point", step_times=rows))


def _every_step_priced(plan, trace, cost) -> bool:
    sim = simulate(plan, trace, steps=cost)
    return sim.step_seconds is not None and not sim.unpriced_points()


def test_only_the_measured_full_graph_is_chosen():
    spec = make_spec(**SPEC)
    plan = compile_plan(spec)
    assert Dispatcher(plan).dispatch(DECODE_256.batch).num_active_loras == 5
    cost = _cost(("graph", 5, 256, 4.0))
    result = optimize(spec, [DECODE_256], cost, max_graphs=167, shared_sizes=True)
    assert result.objective == "step-time"
    assert _every_step_priced(result.plan, [DECODE_256], cost)
    d = Dispatcher(result.plan).dispatch(DECODE_256.batch)
    assert (d.cg_mode, d.num_tokens) == ("FULL", 256)  # the measured graph, not PIECEWISE 512
    assert result.point.step_seconds == pytest.approx(1000 * 4.0 / 1000)
    assert result.point.step_seconds_bounds == (4.0, 4.0)  # measured: no interpolation error
    # per-case sizes too
    per_case = optimize(spec, [DECODE_256], cost, max_graphs=167)
    assert _every_step_priced(per_case.plan, [DECODE_256], cost)


def test_a_choice_that_needs_an_unmeasured_price_is_refused_with_the_points_to_measure():
    spec = make_spec(**SPEC)
    # neither graph is what the trace runs, and eager was measured only up to 64 tokens
    rows = [StepTime(mode="graph", case=5, tokens=128, ms=2.0), StepTime(mode="graph", case=1, tokens=256, ms=3.0)]
    rows += [StepTime(mode="eager", case=5, tokens=t, ms=ms) for t, ms in ((8, 5.0), (64, 9.0))]
    cost = step_times(Calibration(name="one-point", step_times=rows))
    with pytest.raises(UsageError) as err:
        optimize(spec, [DECODE_256], cost, max_graphs=167, shared_sizes=True)
    message = err.value.message + " " + (err.value.hint or "")
    assert "graph case 5 at 256 tokens (1000 steps)" in message
    assert "capplan calibrate-trace" in message and "--padding-fallback" in message
    # the same through the CLI: one line, exit 2 for a usage refusal or 1, nothing written


def test_padding_fallback_only_when_asked_and_said_on_the_last_line(tmp_path):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"num_reqs": 256, "num_tokens": 256, "num_active_loras": 4, "base": True, "count": 1000}) + "\n"
    )
    cal = tmp_path / "cal.yaml"
    rows = [
        {"mode": "graph", "case": 5, "tokens": 128, "ms": 2.0},
        {"mode": "eager", "case": 5, "tokens": 8, "ms": 5.0},
    ]
    cal.write_text(yaml.safe_dump({"name": "one-point", "step_times": rows}))
    out = tmp_path / "s.optimized.yaml"
    args = ["optimize", str(spec_path), str(trace), "--calibration", str(cal), "--max-graphs", "167", "--shared-sizes"]
    refused = runner.invoke(app, args)
    assert refused.exit_code in (1, 2) and "Traceback" not in refused.output
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "graph case 5 at 256 tokens" in refused.stderr
    assert not out.exists()
    chosen = runner.invoke(app, [*args, "--padding-fallback"])
    assert chosen.exit_code == 0, chosen.output
    *_, fallback, last = chosen.stdout.strip().splitlines()
    assert fallback.startswith("chosen by padded tokens, not step time (--padding-fallback)")
    assert last.startswith("on the held-out last 20% of the trace (200 steps; fitted on the first 80%, 800 steps)")
    assert out.exists() and "# chosen by padded tokens" in out.read_text()


def test_interpolated_prices_state_their_bounds_and_max_slowdown_uses_them():
    spec = make_spec(**SPEC)
    trace = [TraceBatch(Batch(n, n, 1, 4, True), 100) for n in (8, 24, 40, 56, 72, 100, 128)]
    rows = [("graph", 5, t, 1.0 + t / 100) for t in (8, 16, 32, 64, 128, 256, 512)]
    rows += [("piecewise", 5, t, 2.0 + t / 50) for t in (8, 16, 32, 64, 128, 256, 512)]
    cost = _cost(*rows)
    default = simulate(compile_plan(spec), trace, steps=cost)
    assert default.step_seconds is not None
    lo, hi = default.clock.lo / 1000, default.clock.hi / 1000
    assert lo <= default.step_seconds <= hi
    tight = optimize(spec, trace, cost, max_slowdown=0.0, shared_sizes=True)
    loose = optimize(spec, trace, cost, max_slowdown=20.0, shared_sizes=True)
    assert tight.point.graphs == tight.default.graphs  # only the default is proven 0% slower
    assert loose.point.graphs < tight.point.graphs
    # proven, not predicted: the bound holds even where interpolation errs the worst way
    for r, pct in ((tight, 0.0), (loose, 0.2)):
        assert r.point.slowdown_bound <= pct + 1e-12
        assert r.point.step_seconds_bounds[1] - r.default.step_seconds_bounds[0] >= 0  # bounds alone prove less
    assert tight.point.step_seconds <= tight.default.step_seconds + 1e-9


def test_simulate_cli_names_unmeasured_points_instead_of_a_number(tmp_path):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    plan = tmp_path / "s.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec_path), "-o", str(plan)]).exit_code == 0
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"num_reqs": 256, "num_tokens": 256, "num_active_loras": 4, "base": True}) + "\n")
    cal = tmp_path / "cal.yaml"
    cal.write_text(
        yaml.safe_dump({"name": "c", "step_times": [{"mode": "graph", "case": 1, "tokens": 256, "ms": 2.0}]})
    )
    text = runner.invoke(app, ["simulate", str(plan), str(trace), "--calibration", str(cal)])
    assert text.exit_code == 0, text.output
    assert (
        "step time not predicted: 1 point(s) the calibration did not measure: graph case 5 at 256 tokens" in text.stdout
    )
    data = json.loads(
        runner.invoke(app, ["simulate", str(plan), str(trace), "--calibration", str(cal), "--json"]).stdout
    )
    assert data["predicted_step_seconds"] is None
    assert data["unpriced_points"] == [{"mode": "graph", "lora_case": 5, "num_tokens": 256, "steps": 1}]


def test_a_70b_spec_is_predicted_as_extrapolated_and_the_small_model_calibration_prices_nothing(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    plan = root / "examples" / "llama3-70b-spec-decode.plan.yaml"
    show = runner.invoke(app, ["show", str(plan)])
    assert show.exit_code == 0
    line = next(x for x in show.stdout.splitlines() if x.startswith("Price:"))
    # no calibration of this model: the shape model predicts, and says how far it extrapolates
    assert "(predicted; predicted by the shape model" in line
    assert "extrapolated: layers 80, 1.7x the largest measured (48)" in show.stdout
    assert "the intervals do not bound the extrapolation" in show.stdout
    assert "vLLM's own estimate stays in charge of the KV cache" in show.stdout
    data = json.loads(runner.invoke(app, ["show", str(plan), "--json"]).stdout)
    assert data["price"]["kind"] == "predicted" and data["price"]["graph_memory_reserve_bytes"] is None
    assert "estimate" not in data  # one price, not a second figure beside it
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"num_reqs": 16, "num_tokens": 64, "max_query_len": 4, "count": 10}\n')
    # optimize prices its budget the way show does: the 70B by the shape model, said
    spec = root / "configs" / "llama3-70b-spec-decode.yaml"
    shown = data["price"]["graph_memory_gib"]["value"]
    out = tmp_path / "x.yaml"
    fits = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graph-memory", str(shown), "-o", str(out)])
    assert fits.exit_code == 0, fits.output
    assert "capture seconds and graph memory: predicted; predicted by the shape model" in fits.stdout
    # without a model in the spec and no calibration: not priced, and what would price it
    qwen = runner.invoke(app, ["show", str(root / "examples" / "qwen3-8b-multilora.plan.yaml")]).stdout
    line = next(x for x in qwen.splitlines() if x.startswith("Price:"))
    assert "~" not in line and "not priced (no probe or start of this deployment: capplan calibrate" in line
    qspec = root / "configs" / "qwen3-8b-multilora.yaml"
    for budget in (["--max-graph-memory", "1"], ["--max-capture-seconds", "10"]):
        refused = runner.invoke(app, ["optimize", str(qspec), str(trace), *budget, "-o", str(tmp_path / "y.yaml")])
        assert refused.exit_code in (1, 2) and "not priced" in refused.stderr


def test_json_output_is_strict():
    from capplan.present.jsondoc import dumps as _dumps

    with pytest.raises(ValueError):
        _dumps({"x": float("nan")})
