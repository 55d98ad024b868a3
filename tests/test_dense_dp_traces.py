"""A dense model's DP ranks are independent engines: `capplan apply --trace` records one trace
per rank, and simulate/optimize take them (each batch dispatched on its own, no DP padding),
as they take one trace per rank of an MoE model (whose ranks pad to one another)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capplan.batches import read_rank_traces
from capplan.commands.traffic import simulate
from capplan.errors import CapplanError
from capplan.loading import spec_from_data
from capplan.planfile.write import render_plan
from capplan.planner import compile_plan

DENSE = {
    "parallel": {"data_parallel_size": 2, "moe": False},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
}


def _plan(tmp: Path) -> Path:
    path = tmp / "dense.plan.yaml"
    path.write_text(render_plan(compile_plan(spec_from_data(DENSE, "dense.yaml")), "dense.yaml", None))
    return path


def _trace(path: Path, batches: list[tuple[int, int]], dp: bool = True) -> Path:
    lines = [
        {"num_reqs": r, "num_tokens": t, "max_query_len": t - r + 1, **({"dp_step": i} if dp else {})}
        for i, (r, t) in enumerate(batches)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_one_trace_per_rank_of_a_dense_plan_is_replayed_as_one(tmp_path):
    plan = _plan(tmp_path)
    a = _trace(tmp_path / "t.rank0.jsonl", [(4, 4), (3, 40)])
    b = _trace(tmp_path / "t.rank1.jsonl", [(1, 1), (8, 8), (2, 300)])
    both = tmp_path / "both.jsonl"
    both.write_text(a.read_text() + b.read_text())
    said: list[str] = []
    ranks = simulate(plan, [a, b], notes=said.append).data
    one = simulate(plan, [_trace(tmp_path / "one.jsonl", [(4, 4), (3, 40), (1, 1), (8, 8), (2, 300)], dp=False)]).data
    assert ranks == one
    assert any("independent engines" in line for line in said)


def test_the_trace_count_is_checked_against_the_plans_ranks(tmp_path):
    spec = spec_from_data(DENSE, "dense.yaml")
    traces = [_trace(tmp_path / f"t{i}.jsonl", [(1, 1)]) for i in range(3)]
    with pytest.raises(CapplanError, match="3 traces for a plan of data_parallel_size 2"):
        read_rank_traces(traces, spec)
    with pytest.raises(CapplanError, match="is given for two ranks"):
        read_rank_traces([traces[0], traces[0]], spec)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 200)), max_size=6), min_size=2, max_size=2))
def test_any_rank_traces_of_a_dense_plan_count_every_batch(tmp_path_factory, ranks):
    tmp = tmp_path_factory.mktemp("dense")
    spec = spec_from_data(DENSE, "dense.yaml")
    paths = [_trace(tmp / f"t{i}.jsonl", [(r, r + extra) for r, extra in rank]) for i, rank in enumerate(ranks)]
    if not any(ranks):
        with pytest.raises(CapplanError, match="every rank trace is empty"):
            read_rank_traces(paths, spec)
        return
    (joined,) = read_rank_traces(paths, spec)
    assert sorted((b.batch.num_reqs, b.batch.num_tokens) for b in joined.batches) == sorted(
        (r, r + extra) for rank in ranks for r, extra in rank
    )
