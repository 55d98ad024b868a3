"""Traces, the simulator and the optimizer."""

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.analysis.verify import verify_plan
from capplan.batches import read_batches
from capplan.calibration.price import load_pricer
from capplan.cli import app
from capplan.errors import CapplanError
from capplan.loading import load_steps
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.traffic.optimize import Bucketing, optimize, token_weights
from capplan.traffic.simulate import TraceBatch, simulate
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "examples" / "traces"
runner = CliRunner()
SMALL = dict(
    scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 128},
    lora={"enabled": True, "max_loras": 4, "specialize_active": True},
)


def _brute(weights: dict[int, int], top: int, k: int) -> int:
    cands = sorted(set(weights) | {top})[:-1]
    best = None
    for n in range(0, min(k - 1, len(cands)) + 1):
        for combo in itertools.combinations(cands, n):
            sizes = [*combo, top]
            cost = sum(w * (min(s for s in sizes if s >= t) - t) for t, w in weights.items())
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_bucketing_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    top = rng.randint(8, 40)
    weights = {rng.randint(1, top): rng.randint(1, 50) for _ in range(rng.randint(1, 9))}
    solver = Bucketing({0: weights}, top)
    for k in range(1, 6):
        padded, sizes = solver.best(k)
        assert padded == _brute(weights, top, k), (weights, top, k)
        assert sizes[-1] == top and len(sizes) <= k and sizes == sorted(set(sizes))
        # the reconstructed sizes really achieve the reported padding
        assert padded == sum(w * (min(s for s in sizes if s >= t) - t) for t, w in weights.items())


def _brute_time(weights, top, k, price, eager):
    cands = sorted({t for w in weights.values() for t in w} | {top})
    best = None
    for n in range(1, min(k, len(cands)) + 1):
        for sizes in itertools.combinations(cands, n):
            cost = 0.0
            for case, w in weights.items():
                for t, steps in w.items():
                    fit = [s for s in sizes if s >= t]
                    cost += steps * (price(case, min(fit)) if fit else eager(case, t))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_step_time_bucketing_is_optimal_against_brute_force(seed):
    """Step-time objective: per-case prices, eager above the largest chosen size (which may
    be below the top)."""
    rng = random.Random(seed)
    top = rng.randint(8, 30)
    cases = rng.sample(range(6), rng.randint(1, 3))
    weights = {c: {rng.randint(1, top): rng.randint(1, 50) for _ in range(rng.randint(1, 5))} for c in cases}
    base = {c: rng.uniform(1, 5) for c in cases}
    slope = {c: rng.uniform(0.01, 0.5) for c in cases}
    launch = rng.uniform(0, 20)  # eager pays a launch overhead a graph does not

    def price(case, size):
        return base[case] + slope[case] * size

    def eager(case, tokens):
        return base[case] + launch + slope[case] * 1.2 * tokens

    solver = Bucketing(weights, top, price, eager)
    for k in range(1, 5):
        value, sizes = solver.best(k)
        assert value == pytest.approx(_brute_time(weights, top, k, price, eager)), (weights, top, k)
        assert 1 <= len(sizes) <= k and sizes == sorted(set(sizes))
        achieved = sum(
            steps * (price(c, min(s for s in sizes if s >= t)) if t <= sizes[-1] else eager(c, t))
            for c, w in weights.items()
            for t, steps in w.items()
        )
        assert value == pytest.approx(achieved)


def _trace(rows):
    return [TraceBatch(Batch(*r[:5]), r[5] if len(r) > 5 else 1) for r in rows]


def test_simulate_counts_hits_padding_eager_and_unused_graphs():
    plan = compile_plan(make_spec(**SMALL))
    trace = _trace(
        [(3, 3, 1, 0, False, 10), (5, 20, 8, 2, True, 2), (4, 4000 // 40, 30, 0, False, 1), (16, 128, 8, 0, False, 1)]
    )
    result = simulate(plan, trace)
    d = Dispatcher(plan)
    expected_pad = 10 * (d.dispatch(trace[0].batch).num_tokens - 3) + 2 * (d.dispatch(trace[1].batch).num_tokens - 20)
    assert result.steps == 14 and result.eager_steps == 2 and result.eager_above_largest == 2  # 100 and 128 > 32
    assert result.padded_tokens == expected_pad and result.real_tokens == 10 * 3 + 2 * 20
    assert len(result.unused) == len(plan.graphs) - len(result.hits) and len(result.hits) == 2
    data = result.to_json(plan)
    assert data["graphs_used"] == 2 and data["graph_hit_rate"] == pytest.approx(12 / 14)


def test_example_traces_load_and_hold_what_they_claim():
    chat = read_batches(TRACES / "chat.jsonl").batches
    assert sum(t.count for t in chat) == 10000
    assert any(t.batch.has_prefill for t in chat)
    multi = read_batches(TRACES / "multitenant.jsonl").batches
    assert sum(t.count for t in multi if t.batch.num_active_loras >= 5) > 0.5 * 10000


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"num_reqs": 0, "num_tokens": 3}', "num_reqs: must be >= 1 (got 0)"),
        ('{"num_reqs": 4, "num_tokens": 3}', "num_tokens (3) must be >= num_reqs (4)"),
        ('{"num_reqs": 2, "num_tokens": 3, "adapters": 2, "base": true}', "base needs a request without an adapter"),
        ('{"num_reqs": 2, "num_tokens": 8, "max_query_len": 9}', "max_query_len must be in 4..7"),
        ('{"num_reqs": 2, "num_tokens": 8, "tokens": 3}', "unknown key 'tokens'"),
        ('{"num_reqs": 2, "num_tokens": 8, "adapters": 1, "num_active_loras": 1}', "adapters and num_active_loras"),
        ('{"num_reqs": 2, "num_tokens": 8, "num_reqs": 3}', "duplicate key 'num_reqs'"),
        ('{"num_reqs": 2, "num_tokens": 8.0}', "num_tokens: must be an integer (got 8.0)"),
        ('{"num_reqs": true, "num_tokens": 8}', "num_reqs: must be an integer (got True)"),
        ('{"num_reqs": 2, "num_tokens": NaN}', "NaN is not a number JSON allows"),
        ('{"num_reqs": 2, "num_tokens": ' + "9" * 5000 + "}", "integer of 5000 digits"),
        ("[1, 2]", "not a JSON batch line"),
        ('{"num_reqs": 2,', "Expecting property name"),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"num_reqs": 1, "num_tokens": 1}\n' + line + "\n")
    with pytest.raises(CapplanError) as err:
        read_batches(path)
    assert f"{path}:2: " in err.value.one_line() and message in err.value.one_line(), err.value.one_line()


def test_vllm_batchsize_log_converts(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO ... Batchsize forward time stats (batchsize, count, median_time(ms)): [(8, 3, 1.2)]\n"
        "INFO ... Batchsize forward time stats (batchsize, count, median_time(ms)): "
        "[(16, 40, 2.5), (8, 12, 1.1), (512, 2, 9.0)]\n"
    )
    trace = read_batches(log).batches
    assert [(t.batch.num_tokens, t.batch.num_reqs, t.count) for t in trace] == [(16, 16, 40), (8, 8, 12), (512, 512, 2)]
    assert read_batches(log).note.startswith("a vLLM batch-size log lists padded token counts only")
    # Against a spec, a batch larger than max_num_seqs becomes max_num_seqs requests of even length.
    spec = make_spec(scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 1024})
    assert [(t.batch.num_reqs, t.batch.max_query_len) for t in read_batches(log, spec).batches][2] == (64, 8)


def test_optimizer_stays_in_budget_keeps_the_top_and_verifies():
    spec = make_spec(**SMALL)
    trace = read_batches(TRACES / "bursty.jsonl").batches
    default = compile_plan(spec)
    result = optimize(spec, trace, load_steps(), max_graphs=len(default.graphs) // 2)
    assert result.point.graphs <= len(default.graphs) // 2 == int(result.budget.split()[0])
    assert result.point.capture_sizes[-1] == default.max_capture_size
    assert verify_plan(result.plan).ok
    # the curve's padding is what the compiled plan's dispatcher sees for token-count-only padding
    weights = token_weights(trace, default.max_capture_size)
    assert result.point.padded_tokens == min(
        p.padded_tokens for p in result.curve if p.graphs <= len(default.graphs) // 2
    )
    assert sum(weights.values()) > 0
    # with the same budget as the default, padding is never worse than the default's
    same = optimize(spec, trace, load_steps(), max_graphs=len(default.graphs))
    assert same.point.padded_tokens <= same.default.padded_tokens


def test_optimize_and_simulate_cli(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "scheduler: {max_num_seqs: 32, max_num_batched_tokens: 8192}\n"
        "lora: {enabled: true, max_loras: 4, specialize_active: true}\n"
    )
    trace = TRACES / "bursty.jsonl"
    small = tmp_path / "small.yaml"
    small.write_text(
        "scheduler: {max_num_seqs: 32, max_num_batched_tokens: 128}\nlora: {enabled: true, max_loras: 4}\n"
    )
    wrong = runner.invoke(app, ["optimize", str(small), str(trace), "--max-graphs", "40"])
    assert wrong.exit_code == 1 and "tokens, more than max_num_batched_tokens 128" in wrong.stderr
    out = runner.invoke(
        app, ["optimize", str(spec), str(trace), "--max-graphs", "60", "--plot", str(tmp_path / "curve.svg")]
    )
    assert out.exit_code == 0, out.output
    assert "<- chosen" in out.stdout and (tmp_path / "s.optimized.yaml").exists()
    assert (tmp_path / "curve.svg").read_text().startswith("<svg")
    comp = runner.invoke(app, ["compile", str(tmp_path / "s.optimized.yaml"), "-o", str(tmp_path / "o.plan.yaml")])
    assert comp.exit_code == 0, comp.output
    sim = runner.invoke(
        app, ["simulate", str(tmp_path / "o.plan.yaml"), str(trace), "--json", "--plot", str(tmp_path / "sim.svg")]
    )
    assert sim.exit_code == 0, sim.output
    data = json.loads(sim.stdout)
    assert data["steps"] == 6000 and data["graphs"] <= 60
    assert (tmp_path / "sim.svg").exists()
    both = runner.invoke(app, ["optimize", str(spec), str(trace)])
    assert both.exit_code == 2 and "give exactly one budget" in both.stderr
    tiny = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "1"])
    assert tiny.exit_code == 2 and "no capture set fits 1 graphs" in tiny.stderr
    bad_plot = runner.invoke(
        app, ["simulate", str(tmp_path / "o.plan.yaml"), str(trace), "--plot", str(tmp_path / "x.gif")]
    )
    assert bad_plot.exit_code == 2 and "use a .svg or .png path" in bad_plot.stderr


def test_per_case_optimizer_matches_brute_force_over_compiled_plans():
    """Every way to give each LoRA case a subset of the candidate sizes (largest kept), compiled:
    the optimizer's choice has the least padding among those within the graph budget."""
    from capplan.planner.dispatch import Dispatcher as D
    from capplan.schemas.spec import Spec

    spec = make_spec(
        scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64},
        cudagraph={"mode": "PIECEWISE"},
        lora={"enabled": True, "max_loras": 1, "specialize_active": True},
    )
    # cases 0, 1, 2 (1 adapter + base = 2 kernel slots); token counts 1, 3, 5, 13 and the top, 16
    rows = [
        (1, 1, 1, 0, False, 30),
        (3, 3, 1, 0, False, 9),
        (2, 5, 3, 1, False, 7),
        (3, 3, 1, 1, True, 12),
        (5, 5, 1, 1, True, 5),
        (5, 13, 3, 0, False, 4),
        (4, 13, 4, 1, False, 6),
    ]
    trace = _trace(rows)
    top = compile_plan(spec).max_capture_size
    d = D(compile_plan(spec))
    cases = compile_plan(spec).lora_capture_cases
    cands = sorted({r[1] for r in rows} | {top})
    budget = 8

    def padding_of(plan):
        return simulate(plan, trace).padded_tokens

    best = None
    per_case_subsets = [
        list(itertools.chain.from_iterable(itertools.combinations(cands[:-1], n) for n in range(len(cands))))
    ] * len(cases)
    for choice in itertools.product(*per_case_subsets):
        sizes = {c: sorted({*s, top}) for c, s in zip(cases, choice)}
        union = sorted({x for v in sizes.values() for x in v})
        data = spec.model_dump(mode="json")
        data["cudagraph"].update(
            capture_sizes=union,
            max_capture_size=None,
            lora_case_sizes=[{"case": c, "sizes": v} for c, v in sizes.items() if v != union] or None,
        )
        plan = compile_plan(Spec.model_validate(data), with_deviations=False)
        if len(plan.graphs) <= budget:
            p = padding_of(plan)
            best = p if best is None else min(best, p)
    result = optimize(spec, trace, load_steps(), max_graphs=budget, blocks=1)  # as fitted: no folds
    assert result.point.graphs <= budget
    assert padding_of(result.plan) == result.point.padded_tokens == best
    assert d.lora_case(d.lora_count(trace[4].batch)) == 2  # 1 adapter + base -> case 2 (kernel slots)


def test_optimize_with_a_memory_budget():
    spec = make_spec(**SMALL)
    trace = read_batches(TRACES / "multitenant.jsonl").batches
    toy = Path(__file__).resolve().parents[1] / "src" / "capplan" / "data" / "h200-vllm025.yaml"
    steps, pricer = load_steps(toy), load_pricer(toy)
    default = optimize(spec, trace, steps, pricer=pricer, max_graphs=10_000).default
    # The memory price has a base (the shared pool's workspace), so half the default's
    # memory may be below any plan's; three quarters leaves room for fewer graphs.
    budget = default.graph_memory_gib * 0.75
    result = optimize(spec, trace, steps, pricer=pricer, max_graph_memory=budget)
    assert result.point.graph_memory_gib <= budget and result.point.graphs < default.graphs
    assert "GiB graph memory" in result.budget and verify_plan(result.plan).ok


@settings(max_examples=150, deadline=None)
@given(
    weights=st.dictionaries(st.integers(1, 40), st.integers(1, 50), min_size=1, max_size=8),
    extra=st.sets(st.integers(1, 40), max_size=6),
    ratio=st.sampled_from([1.5, 2.0, 3.0]),
    k=st.integers(1, 6),
)
def test_bounded_bucketing_matches_brute_force(weights, extra, ratio, k):
    """Under a padding bound (no count, traced or not, pads past ratio times itself) the
    exact bucketing equals the best of every subset of candidates that meets the bound."""
    from itertools import combinations

    from capplan.traffic.optimize import INF, Bucketing, worst_pad

    top = 40
    sizes = sorted(set(weights) | extra | {top})
    solver = Bucketing({0: weights}, top, sizes=sizes, max_pad=ratio)
    value, chosen = solver.best(k)

    def padding(subset):
        return sum(n * (min(s for s in subset if s >= t) - t) for t, n in weights.items())

    best = INF
    for r in range(1, min(k, len(sizes)) + 1):
        for subset in combinations(sizes, r):
            if top in subset and worst_pad(list(subset)) <= ratio:
                best = min(best, padding(subset))
    assert value == best
    if best < INF:
        assert top in chosen and worst_pad(chosen) <= ratio and padding(chosen) == best
