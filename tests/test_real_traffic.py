"""The real-traffic loop on CPU: the trace recorder, the step-time model, step-time optimize, calibrate's plans."""

import json
import os
import stat
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.batches import read_batches
from capplan.calibration.price import Pricer, fit_runs, load_pricer, runs_price
from capplan.cli import app
from capplan.errors import InputError
from capplan.offline.calibrate import case_batches, decode_sizes, engines
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.runtime.recorder import Recorder, trace_path
from capplan.schemas.calibration import Calibration, StepTime
from capplan.traffic.optimize import optimize
from capplan.traffic.simulate import TraceBatch, simulate
from capplan.traffic.steps import Price, StepModel, step_times
from tests.conftest import make_spec

runner = CliRunner()
SPEC = dict(
    scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 512},
    lora={"enabled": True, "max_loras": 2, "specialize_active": True},
)
RUNS = [
    {
        "label": "small",
        "no_lora_graphs": 2,
        "lora_graphs": 8,
        "max_tokens": 1,
        "capture_seconds": 3.0,
        "graph_memory_gib": 0.07,
    },
    {
        "label": "full",
        "no_lora_graphs": 80,
        "lora_graphs": 320,
        "max_tokens": 512,
        "capture_seconds": 45.0,
        "graph_memory_gib": 0.9,
    },
    {
        "label": "no lora",
        "no_lora_graphs": 20,
        "lora_graphs": 0,
        "max_tokens": 512,
        "capture_seconds": 2.5,
        "graph_memory_gib": 0.18,
    },
]


def _calibration(graph, eager, cases=(0, 1, 2, 3), tokens=(1, 8, 64, 512)) -> Calibration:
    rows = [
        StepTime(mode=mode, case=c, tokens=t, ms=fn(c, t))
        for mode, fn in (("graph", graph), ("eager", eager))
        for c in cases
        for t in tokens
    ]
    return Calibration(name="test", runs=RUNS, step_times=rows)


# --- recorder ---------------------------------------------------------------


def test_recorder_writes_a_trace_simulate_reads(tmp_path):
    path = tmp_path / "trace.jsonl"
    rec = Recorder(str(path), 1 << 20, "header")
    rec.step(8, 8, 1, 2, True, False)
    rec.step(3, 400, 300, 0, False, True)
    rec.step(4, 4, 1, 1, False, False)
    rec.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 & ~_umask()
    spec = make_spec(**SPEC)
    batches = read_batches(path, spec).batches
    got = [(b.batch.num_reqs, b.batch.num_tokens, b.batch.max_query_len, b.batch.num_active_loras, b.batch.base,
            b.batch.has_prefill) for b in batches]  # fmt: skip
    assert got == [(8, 8, 1, 2, True, False), (3, 400, 300, 0, False, True), (4, 4, 1, 1, False, False)]
    lines = path.read_text().splitlines()
    assert lines[0] == "# header"
    times = [json.loads(line)["t"] for line in lines[1:]]
    assert times == sorted(times)
    assert rec.to_json()["steps"] == 3 and rec.to_json()["overhead_us_per_step"] > 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_recorder_stops_at_its_limit_and_says_so(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    rec = Recorder(str(path), 400, "h")
    for _ in range(50):
        rec.step(8, 8, 1, 0, False, False)
    rec.close()
    text = path.read_text()
    assert (
        len(text.encode()) <= 400 + 100
    )  # the recorder's last line (why it stopped) may pass the limit; no batch line does
    assert "stopped at the" in text.splitlines()[-1]
    assert "stopped at the" in capsys.readouterr().err
    assert rec.to_json()["stopped"]
    assert 0 < len(read_batches(path).batches) < 50


def test_recorder_flushes_in_the_background(tmp_path):
    path = tmp_path / "trace.jsonl"
    rec = Recorder(str(path), 1 << 20, "h")
    rec.step(1, 1, 1, 0, False, False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and '"num_reqs"' not in path.read_text():
        time.sleep(0.1)
    assert '"num_reqs": 1' in path.read_text()  # written without close()
    rec.close()


def test_trace_path_per_dp_rank():
    assert trace_path("/t/trace.jsonl", 0, 1) == "/t/trace.jsonl"
    assert trace_path("/t/trace.jsonl", 1, 2) == "/t/trace.rank1.jsonl"
    assert trace_path("/t/trace-{rank}.jsonl", 1, 2) == "/t/trace-1.jsonl"


@pytest.mark.parametrize(
    ("tp_rank", "first_stage", "records"), [(0, True, True), (1, True, False), (0, False, False), (1, False, False)]
)
def test_one_worker_of_each_dp_rank_records_its_steps(monkeypatch, tp_rank, first_stage, records):
    """Every TP worker and pipeline stage runs the same steps and would write the same file: TP
    rank 0 of the first stage alone records (vLLM's groups stood in for)."""
    import sys
    import types

    from capplan.runtime.hooks.record import _records_here

    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tensor_model_parallel_rank = lambda: tp_rank  # type: ignore[attr-defined]
    state.get_pp_group = lambda: types.SimpleNamespace(is_first_rank=first_stage)  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    assert _records_here() is records
    monkeypatch.delitem(sys.modules, "vllm.distributed.parallel_state")
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", None)  # no vLLM groups here
    assert _records_here() is True


def test_apply_trace_refuses_an_unwritable_folder(tmp_path):
    plan = tmp_path / "p.plan.yaml"
    spec = tmp_path / "s.yaml"
    spec.write_text("lora: {enabled: true, max_loras: 2}\n")
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    result = runner.invoke(app, ["apply", str(plan), "--trace", str(tmp_path / "no" / "t.jsonl"), "--", "true"])
    assert result.exit_code == 2
    assert "is not a writable folder" in result.output


# --- step model -------------------------------------------------------------


def test_step_model_prices_only_what_was_measured_or_lies_between():
    model = StepModel(
        [
            StepTime(mode="graph", case=0, tokens=8, ms=2.0),
            StepTime(mode="graph", case=0, tokens=64, ms=1.5),  # noisy: below the smaller size
            StepTime(mode="graph", case=0, tokens=128, ms=4.0),
            StepTime(mode="graph", case=4, tokens=8, ms=3.0),
        ]
    )
    assert model.price("graph", 0, 8) == Price(2.0, 2.0, 2.0)
    assert model.price("graph", 0, 64).ms == 2.0  # made non-decreasing
    mid = model.price("graph", 0, 96)
    assert mid.ms == pytest.approx(3.0) and (mid.lo, mid.hi) == (2.0, 4.0)  # the neighbours bound it
    assert model.price("graph", 0, 1) is None  # below the first point: not extrapolated
    assert model.price("graph", 0, 192) is None  # above the last point: not extrapolated
    assert model.price("graph", 3, 8) is None  # no case stands in for another
    assert model.price("piecewise", 0, 8) is None  # nor a mode for another
    assert model.price("eager", 0, 8) is None


def test_calibration_values_are_finite_non_negative_numbers():
    from pydantic import ValidationError

    for bad in (float("nan"), float("inf"), -1.0, True, "2"):
        with pytest.raises(ValidationError):
            StepTime(mode="graph", case=0, tokens=8, ms=bad)
        with pytest.raises(ValidationError):
            Calibration.model_validate({"name": "x", "runs": [{**RUNS[0], "capture_seconds": bad}, *RUNS[1:]]})
    assert step_times(Calibration(name="x", runs=RUNS)).model is None


def test_a_fit_with_a_negative_cost_is_refused():
    runs = [dict(r) for r in RUNS]
    runs[2]["capture_seconds"] = 60.0  # 20 plain graphs cost more than 80 plain + 320 LoRA graphs
    with pytest.raises(InputError, match="negative cost"):
        fit_runs(Calibration.model_validate({"name": "x", "runs": runs}))


def test_capture_runs_fit_small_and_large_plans_exactly_from_three_kinds_of_runs():
    r = fit_runs(_calibration(lambda c, t: 1.0, lambda c, t: 2.0))
    for run in RUNS:
        est = r.per_graph * run["no_lora_graphs"] + r.per_lora_graph * run["lora_graphs"]
        est += r.lora_fixed if run["lora_graphs"] else 0.0
        assert est == pytest.approx(run["capture_seconds"])
        graphs = run["no_lora_graphs"] + run["lora_graphs"]
        gib = r.base_gib + r.gib_per_max_token * run["max_tokens"] + r.gib_per_graph * graphs
        assert gib == pytest.approx(run["graph_memory_gib"])


def test_graph_memory_follows_the_largest_graph_not_only_the_count():
    """Measured under `vllm serve` (vLLM 0.25.1, H200, the served example's model): the
    default plan (418 graphs), per-case sizes (123 graphs, 60 sizes for one case and only
    512 for the others) and shared sizes (85, 165 and 255 graphs). The calibration `capplan
    calibrate` wrote offline for that model estimates each within 10%."""
    from capplan.loading import load_calibration, load_spec

    served = Path(__file__).resolve().parents[1] / "examples" / "served"
    cal = load_calibration(served / "h200-vllm0.25.1-llama0.9b.yaml")
    measured = {"llama0.9b.yaml": 0.9316, "llama0.9b.percase.yaml": 0.3809, "llama0.9b.shared.yaml": 0.4414}
    measured |= {"llama0.9b.shared85.yaml": 0.3027, "llama0.9b.shared255.yaml": 0.5977}
    for name, gib in measured.items():
        priced = runs_price(compile_plan(load_spec(served / name)), cal)
        assert priced.gib.value == pytest.approx(gib, rel=0.10), name
    assert fit_runs(cal).gib_per_max_token > 0  # the largest graph's workspace is a cost of its own


def test_simulate_predicts_step_time_from_the_dispatch():
    cost = step_times(_calibration(lambda c, t: 1.0 + c + t / 100, lambda c, t: 10.0 + c + t / 50))
    plan = compile_plan(make_spec(**SPEC))
    trace = [
        TraceBatch(Batch(8, 8, 1, 2, False), 10),  # a graph
        TraceBatch(Batch(3, 500, 300, 0, False, True), 2),  # above the largest graph: eager
    ]
    result = simulate(plan, trace, steps=cost)
    d = Dispatcher(plan)
    g = d.dispatch(trace[0].batch)
    e = d.dispatch(trace[1].batch)
    assert e.graph_id < 0 <= g.graph_id
    expected = (
        10 * cost.model.price("graph", g.num_active_loras, g.num_tokens).ms
        + 2 * cost.model.price("eager", e.num_active_loras, 500).ms
    )
    assert result.step_ms == pytest.approx(expected)
    assert result.to_json(plan)["predicted_step_seconds"] == round(expected / 1000, 6)
    assert simulate(plan, trace).to_json(plan)["predicted_step_seconds"] is None


# --- optimize on step time ----------------------------------------------------


def _decode_trace(sizes_and_counts, adapters=1):
    return [TraceBatch(Batch(n, n, 1, adapters, False), c) for n, c in sizes_and_counts]


def test_step_time_objective_drops_the_largest_size_when_eager_costs_no_more():
    """PIECEWISE-only style economics: eager costs as much as a graph replay, so a graph
    earns nothing; under one shared size list the top size is dropped."""
    cost = step_times(_calibration(lambda c, t: 1.0 + t / 10, lambda c, t: 1.0 + t / 10))
    spec = make_spec(**SPEC)
    trace = _decode_trace([(3, 100), (20, 50), (60, 10)])
    result = optimize(spec, trace, cost, max_graphs=10_000, shared_sizes=True)
    assert result.objective == "step-time"
    assert max(result.point.capture_sizes) < max(result.default.capture_sizes)
    assert result.point.step_seconds <= result.default.step_seconds


def test_step_time_objective_keeps_graphs_when_eager_is_slow():
    cost = step_times(_calibration(lambda c, t: 1.0 + t / 100, lambda c, t: 20.0 + t / 100))
    spec = make_spec(**SPEC)
    trace = _decode_trace([(3, 100), (20, 50), (60, 10)])
    result = optimize(spec, trace, cost, max_graphs=10_000, shared_sizes=True)
    assert {3, 20, 60} <= set(result.point.capture_sizes)  # every size the trace uses: no padding at all
    assert result.point.padded_tokens == 0


def test_step_time_objective_weighs_padding_against_graph_budget_per_case():
    cost = step_times(_calibration(lambda c, t: 1.0 + t / 10, lambda c, t: 50.0 + t))
    spec = make_spec(**SPEC)
    trace = _decode_trace([(3, 100), (20, 50), (60, 10)], adapters=1) + _decode_trace([(5, 30)], adapters=2)
    default_graphs = len(compile_plan(spec).graphs)
    result = optimize(spec, trace, cost, max_graphs=default_graphs // 3)
    assert result.point.graphs <= default_graphs // 3
    assert result.point.step_seconds <= min(p.step_seconds for p in result.curve if p.graphs <= default_graphs // 3)
    # the prediction of the chosen point is what simulate predicts for its plan
    sim = simulate(result.plan, trace, steps=cost)
    assert sim.step_ms / 1000 == pytest.approx(result.point.step_seconds, abs=1e-3)


def test_step_time_needs_step_times():
    cost = step_times(Calibration(name="x", runs=RUNS))
    spec = make_spec(**SPEC)
    with pytest.raises(Exception, match="no step times"):
        optimize(spec, _decode_trace([(3, 1)]), cost, max_graphs=50, objective="step-time")
    assert optimize(spec, _decode_trace([(3, 1)]), cost, max_graphs=500).objective == "padding"


def test_capture_seconds_budget():
    cal = _calibration(lambda c, t: 1.0, lambda c, t: 2.0)
    spec = make_spec(**SPEC)
    trace = _decode_trace([(3, 100), (20, 5)])
    result = optimize(spec, trace, step_times(cal), pricer=Pricer(cal), max_capture_seconds=10.0)
    # held to the budget by the price's upper bound (the scaled runs here have no interval: the value)
    assert result.point.capture_seconds_hi is not None and result.point.capture_seconds_hi <= 10.0
    assert result.point.capture_seconds <= result.point.capture_seconds_hi
    assert result.budget == "10.0 s capture (the price's upper bound)"


# --- calibrate's engines ------------------------------------------------------


def test_calibrate_builds_three_engines_that_identify_the_cost_model():
    spec = make_spec(**SPEC)
    built = engines(spec)
    assert [m for _, _, m in built] == ["graph", "eager", None]
    plans = [compile_plan(s) for _, s, _ in built]
    rows = []
    for plan in plans:
        lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
        rows.append([len(plan.graphs) - lora, lora, 1.0 if lora else 0.0])
    assert rows[2][1] == 0  # the middle plan has LoRA off
    assert plans[1].capture_sizes == [1]
    # the three rows are independent: the 3-coefficient fit is determined
    a, b, c = rows
    det = a[0] * (b[1] * c[2] - b[2] * c[1]) - a[1] * (b[0] * c[2] - b[2] * c[0]) + a[2] * (b[0] * c[1] - b[1] * c[0])
    assert det != 0
    # and so is the memory fit: base, the largest graph's tokens, the graph count
    a, b, c = [[1.0, max(g.descriptor.num_tokens for g in p.graphs), len(p.graphs)] for p in plans]
    det = a[0] * (b[1] * c[2] - b[2] * c[1]) - a[1] * (b[0] * c[2] - b[2] * c[0]) + a[2] * (b[0] * c[1] - b[1] * c[0])
    assert det != 0


def test_calibrate_drives_every_lora_case():
    plan = compile_plan(make_spec(**SPEC))
    cases = case_batches(plan, num_adapters=4, num_reqs=8)
    assert sorted(cases) == sorted(plan.lora_capture_cases)
    d = Dispatcher(plan)
    for case, (k, base) in cases.items():
        assert d.lora_case(d.lora_count(Batch(8, 8, 1, k, base))) == case
    assert decode_sizes(plan) == [1, 2, 4, 8, 16, 32, 64]


def test_calibrate_without_vllm_is_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("lora: {enabled: true, max_loras: 2}\n")
    result = runner.invoke(
        app, ["calibrate-steps", str(spec), "--model", str(tmp_path), "-o", str(tmp_path / "c.yaml")]
    )
    assert result.exit_code == 1
    assert "vLLM" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "c.yaml").exists()


def test_simulate_cli_prints_predicted_step_time(tmp_path):
    import yaml

    cal = _calibration(lambda c, t: 1.0 + t / 100, lambda c, t: 5.0 + t / 50)
    cal_path = tmp_path / "cal.yaml"
    cal_path.write_text(yaml.safe_dump(cal.model_dump()))
    spec = tmp_path / "s.yaml"
    spec.write_text("scheduler: {max_num_seqs: 64, max_num_batched_tokens: 512}\nlora: {enabled: true, max_loras: 2}\n")
    plan = tmp_path / "p.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"num_reqs": 8, "num_tokens": 8, "num_active_loras": 1, "t": 0.5}\n')
    result = runner.invoke(app, ["simulate", str(plan), str(trace), "--calibration", str(cal_path)])
    assert result.exit_code == 0, result.output
    assert "predicted step time" in result.output
    data = json.loads(
        runner.invoke(app, ["simulate", str(plan), str(trace), "--calibration", str(cal_path), "--json"]).output
    )
    assert data["predicted_step_seconds"] == pytest.approx(0.00108, abs=1e-5)


def test_shipped_calibration_loads():
    from capplan.loading import load_calibration, load_steps
    from capplan.traffic.steps import DEFAULT_CALIBRATION

    assert fit_runs(load_calibration(DEFAULT_CALIBRATION)).per_graph > 0
    assert Path(load_steps(DEFAULT_CALIBRATION).name)  # a name, whatever the shipped file calls itself
    # without --calibration its runs (a 0.9B model's, on an H200) price no deployment's capture
    bare = load_pricer().price(compile_plan(make_spec(**SPEC)))
    assert bare.kind == "not priced" and bare.seconds is None and "capplan calibrate" in bare.basis


# --- step times as served ----------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SERVED = EXAMPLES / "served"


def _busy_seconds(times, gap=0.1):
    return sum(b - a for a, b in zip(times, times[1:]) if 0 < b - a <= gap)


def test_step_times_fitted_on_one_served_sample_predict_the_other():
    """Traces recorded under `vllm serve` on an H200 (examples/served/): fitted on
    sample A, the model prices 98% of sample B's steps and predicts their measured
    time within 5%; it names the rest (points A never reached) instead of guessing them.
    The offline calibration alone (decode steps timed through LLM.generate) has no
    PIECEWISE times at all, so it prices no prediction for B."""
    from capplan.loading import load_calibration
    from capplan.planfile import load_plan
    from capplan.traffic.simulate import StepClock
    from capplan.traffic.steps import fit_step_times, merge_step_times

    plan = load_plan(SERVED / "llama0.9b.plan.yaml")
    a = read_batches(SERVED / "trace-a.jsonl", plan.spec)
    b = read_batches(SERVED / "trace-b.jsonl", plan.spec)
    offline = load_calibration(SERVED / "h200-vllm0.25.1-llama0.9b.yaml")
    fitted = fit_step_times(plan, a.batches, a.times)
    served = step_times(
        Calibration(name="s", runs=offline.runs, step_times=merge_step_times(offline.step_times, fitted))
    )
    d = Dispatcher(plan)
    clock = StepClock(served.model)
    measured = predicted = 0.0
    busy = priced = 0
    for i in range(1, len(b.batches)):
        dt = b.times[i] - b.times[i - 1]
        if not 0 < dt <= 0.1:
            continue
        busy += 1
        batch = b.batches[i].batch
        price = served.model.price(*clock.point(d.dispatch(batch), batch.num_tokens).__dict__.values())
        if price is not None:
            priced += 1
            measured += dt
            predicted += price.ms / 1000
    assert priced / busy > 0.98, (priced, busy)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
    whole = simulate(plan, b.batches, steps=served)
    assert whole.step_seconds is None and whole.unpriced_points()  # the rest is named, not guessed
    alone = simulate(plan, b.batches, steps=step_times(offline))
    assert alone.step_seconds is None
    assert any(p.mode == "piecewise" for p, _ in alone.unpriced_points())
    modes = {r.mode for r in fitted}
    assert modes == {"graph", "piecewise", "eager"}


def test_merge_keeps_base_rows_only_below_what_the_fit_reached():
    from capplan.traffic.steps import merge_step_times

    base = [StepTime(mode="eager", case=0, tokens=t, ms=float(t)) for t in (2, 64, 600, 1000)]
    fitted = [StepTime(mode="eager", case=0, tokens=t, ms=50.0) for t in (500, 900)]
    merged = merge_step_times(base, fitted)
    assert [(r.tokens, r.ms) for r in merged] == [(2, 2.0), (64, 64.0), (500, 50.0), (900, 50.0)]


def test_calibrate_trace_cli(tmp_path):
    out = tmp_path / "served.yaml"
    args = [
        "calibrate-trace",
        str(SERVED / "llama0.9b.plan.yaml"),
        str(SERVED / "trace-a.jsonl"),
        "--calibration",
        str(SERVED / "h200-vllm0.25.1-llama0.9b.yaml"),
        "-o",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert out.read_text() == (SERVED / "h200-vllm0.25.1-llama0.9b-served.yaml").read_text()  # the shipped file
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text('{"num_reqs": 8, "num_tokens": 8}\n')
    args[2], args[-1] = str(untimed), str(tmp_path / "x.yaml")
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "no step times" in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_decode_batches_are_priced_full_up_to_the_largest_full_size_then_piecewise():
    from capplan.traffic.optimize import Objective

    rows = [
        StepTime(mode=m, case=c, tokens=t, ms=ms)
        for c in (0, 1, 2, 3)
        for t in (1, 512)
        for m, ms in (("graph", 1.0), ("piecewise", 5.0), ("eager", 20.0))
    ]
    cost = step_times(Calibration(name="x", runs=RUNS, step_times=rows))
    spec = make_spec(**SPEC)
    trace = [TraceBatch(Batch(8, 8, 1, 1, False), 3), TraceBatch(Batch(2, 40, 30, 1, False, True), 2)]
    goal = Objective(spec, [trace], 128, compile_plan(spec), cost, Pricer(), "step-time")
    (case,) = goal.groups
    kinds = {kind: w for (_, kind), w in goal.groups[case].items()}
    assert kinds == {"full": {8: 3}, "piecewise": {40: 2}}
    assert goal.full_max == 40  # the largest candidate size (8, 40, 128) vLLM captures FULL (<= 64 decode tokens)
    assert goal.price((case, "full"), 40) == 1.0 and goal.price((case, "full"), 128) == 5.0
    assert goal.price((case, "piecewise"), 8) == 5.0


def test_a_calibration_without_max_tokens_says_what_to_add(tmp_path):
    cal = tmp_path / "old.yaml"
    cal.write_text(
        "name: old\nruns:\n"
        + "".join(
            f"  - {{label: r{i}, no_lora_graphs: 86, lora_graphs: {n}, capture_seconds: 8, graph_memory_gib: 0.3}}\n"
            for i, n in enumerate((0, 86, 344))
        )
    )
    result = runner.invoke(app, ["show", str(EXAMPLES / "served" / "llama0.9b.plan.yaml"), "--calibration", str(cal)])
    assert result.exit_code == 1
    assert "runs.0.max_tokens: is required" in result.output and "tokens of its largest graph" in result.output


def test_calibrate_records_the_model_it_measured(tmp_path):
    """The identity a calibration records comes from the model's own files (config.json and
    the safetensors headers), read without torch; it validates as a calibration identity."""
    import struct

    from capplan.offline.calibrate import model_identity
    from capplan.schemas.calibration import Identity

    base = tmp_path / "llama-tiny" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "torch_dtype": "bfloat16",
            }
        )
    )
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "BF16", "shape": [2048, 256], "data_offsets": [0, 0]},
            "b": {"dtype": "BF16", "shape": [256], "data_offsets": [0, 0]},
        }
    ).encode()
    (base / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    got = model_identity(base)
    assert got == {
        "name": "llama-tiny",
        "architecture": "LlamaForCausalLM",
        "hidden_size": 256,
        "num_layers": 2,
        "dtype": "bfloat16",
        "parameters": 2048 * 256 + 256,
    }
    assert Identity.model_validate({"model": got, "gpu": "NVIDIA H200"}).model.parameters == 2048 * 256 + 256


def test_a_budget_holds_the_prices_upper_bound_not_its_value():
    from dataclasses import replace

    from capplan.traffic.optimize import Budget, CurvePoint

    point = CurvePoint(4, 40, 0.9, 9.0, 0, 0.0, [1, 2, 4, 8], make_spec(**SPEC))
    inside = replace(point, graph_memory_gib_hi=0.95, capture_seconds_hi=9.5)
    straddles = replace(point, graph_memory_gib_hi=1.2, capture_seconds_hi=12.0)
    assert Budget(max_graph_memory=1.0).fits(inside) and not Budget(max_graph_memory=1.0).fits(straddles)
    assert Budget(max_capture_seconds=10.0).fits(inside) and not Budget(max_capture_seconds=10.0).fits(straddles)
    assert not Budget(max_graph_memory=1.0).fits(point)  # not priced to an upper bound: never within a budget
