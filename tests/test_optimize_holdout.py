"""optimize on traffic it did not fit: time-ordered folds, the spec's own sizes kept when the
fitted ones do worse on the held-out steps, single decodes kept, every figure labelled with
the steps it is on, and the user's spec header kept."""

from __future__ import annotations

import dataclasses
import json
from itertools import combinations

import pytest
import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.cli import app
from capplan.errors import SpecError
from capplan.loading import load_steps
from capplan.planner import Batch
from capplan.traffic.folds import held_out_scores, padded, smoothed, time_blocks
from capplan.traffic.optimize import INF, Bucketing, optimize, worst_pad
from capplan.traffic.simulate import TraceBatch
from tests.conftest import make_spec

runner = CliRunner()
HEADER = "# our chat deployment: owned by the platform team\n# keep max_num_seqs in step with the gateway\n"
SPEC = "scheduler: {max_num_seqs: 128, max_num_batched_tokens: 512}\n"


def _decodes(tokens: int, count: int) -> dict:
    return {"num_reqs": tokens, "num_tokens": tokens, "max_query_len": 1, "count": count}


def _write(tmp_path, rows: list[dict]):
    spec = tmp_path / "deploy.yaml"
    spec.write_text(HEADER + SPEC)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spec, trace


def test_drifting_traffic_keeps_the_specs_own_sizes_and_says_why(tmp_path):
    """Fitted on small batches, held out on large ones: the fitted set pads the large ones
    far more than vLLM's sizes do, so the spec's own sizes are written, with the reason."""
    rows = [_decodes(3, 300), _decodes(5, 300), _decodes(9, 200)] + [_decodes(t, 20) for t in range(97, 107)]
    spec, trace = _write(tmp_path, rows)
    out = tmp_path / "o.yaml"
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "30", "-o", str(out)])
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("kept: the best ") and "do worse than the spec's own on the held-out last 20%" in last
    assert "padding " in last and "against" in last
    written = out.read_text()
    assert HEADER in written  # the user's header comment survives
    assert yaml.safe_load(written)["cudagraph"]["capture_sizes"] is None  # the spec's own sizes
    assert "# the spec's own capture sizes" in written
    data = json.loads(
        runner.invoke(
            app, ["optimize", str(spec), str(trace), "--max-graphs", "30", "-o", str(tmp_path / "j.yaml"), "--json"]
        ).stdout
    )
    assert data["kept_default"] == last.removeprefix("kept: ")


def test_fitted_spec_keeps_the_users_header_and_labels_each_padding_figure(tmp_path):
    rows = [_decodes(t, 50) for t in (3, 5, 9, 17, 30)] * 4
    spec, trace = _write(tmp_path, rows)
    out = tmp_path / "o.yaml"
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "40", "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert "padded tokens on the fitted first 80% of the trace (800 steps)" in lines[0]
    default_line = next(x for x in lines if x.startswith("  default capture set:"))
    assert default_line.endswith("on the fitted first 80% of the trace (800 steps)")
    wrote = next(x for x in lines if x.startswith("wrote "))
    assert "padding" not in wrote  # one padding figure per set: the held-out one, on the last line
    assert lines[-1].startswith("on the held-out last 20% of the trace (200 steps; fitted on the first 80%, 800 steps)")
    written = out.read_text()
    assert HEADER in written and written.index("# capplan optimize") < written.index(HEADER)
    whole = runner.invoke(
        app, ["optimize", str(spec), str(trace), "--max-graphs", "40", "-o", str(out), "--holdout", "0"]
    )
    assert whole.exit_code == 0, whole.output
    assert "on the whole trace" in whole.stdout.strip().splitlines()[-1]


def test_a_padding_bound_no_set_meets_is_one_line_even_with_the_fallback(tmp_path):
    """--max-pad-ratio 1 leaves no candidate set: a one-line refusal that asks for no prices (the
    padded-tokens objective needs none), nothing written; under --padding-fallback too."""
    spec, trace = _write(tmp_path, [_decodes(t, 30) for t in (3, 5, 9, 17, 30)])
    out = tmp_path / "o.yaml"
    for extra in ([], ["--padding-fallback"]):
        result = runner.invoke(
            app,
            ["optimize", str(spec), str(trace), "--max-graphs", "40", "--max-pad-ratio", "1", "-o", str(out), *extra],
        )
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert len(result.stderr.strip().splitlines()) == 1
        assert "within the padding bound of 1x" in result.stderr
        assert "price" not in result.stderr and "calibrat" not in result.stderr  # padding needs no step times
        assert not out.exists()


def test_single_decodes_keep_size_one():
    """A rare single-request decode still gets its own graph: padding it to 2 doubles its work."""
    spec = make_spec(scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 256})
    trace = [TraceBatch(Batch(1, 1, 1), 1)] + [TraceBatch(Batch(n, n, 1), 500) for n in (2, 6, 12, 24, 48)]
    result = optimize(spec, trace, load_steps(), max_graphs=10, blocks=1)
    assert result.point.capture_sizes[0] == 1
    without = optimize(spec, [t for t in trace if t.batch.num_tokens > 1], load_steps(), max_graphs=10, blocks=1)
    assert 1 not in without.point.capture_sizes  # the rule, not the trace's weight, keeps it


def test_capture_not_priced_prints_no_placeholder():
    from capplan.present.optimize import render_curve

    spec = make_spec(scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 64})
    trace = [TraceBatch(Batch(n, n, 1), 10) for n in (1, 3, 7, 12)]
    result = optimize(spec, trace, load_steps(), max_graphs=40)
    withheld = dataclasses.replace(result, default=dataclasses.replace(result.default, graph_memory_gib=None))
    text = render_curve(withheld)
    assert "~- GiB" not in text and "graph memory not priced" in text
    assert "capture seconds and graph memory: not priced: no probe or start of this deployment" in text


@settings(max_examples=150, deadline=None)
@given(
    weights=st.dictionaries(st.integers(1, 30), st.integers(1, 50), min_size=1, max_size=7),
    required=st.sets(st.integers(1, 30), max_size=2),
    ratio=st.sampled_from([None, 2.0, 3.0]),
    k=st.integers(1, 6),
)
def test_required_sizes_bucketing_matches_brute_force(weights, required, ratio, k):
    """With required sizes, the exact bucketing equals the best subset that holds them all."""
    top = 30
    sizes = sorted(set(weights) | required | {top})
    solver = Bucketing({0: weights}, top, sizes=sizes, max_pad=ratio, required=required)
    value, chosen = solver.best(k)
    best = INF
    for r in range(1, min(k, len(sizes)) + 1):
        for subset in combinations(sizes, r):
            if top in subset and required <= set(subset) and (ratio is None or worst_pad(list(subset)) <= ratio):
                best = min(best, padded(list(subset), weights))
    assert value == best
    if best < INF:
        assert required <= set(chosen) and padded(chosen, weights) == best


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=25),
    blocks=st.integers(1, 6),
)
def test_time_blocks_cut_the_steps_in_order_into_near_equal_parts(counts, blocks):
    trace = [TraceBatch(Batch(t, t, 1), n) for t, n in counts]
    parts = time_blocks(trace, blocks)
    total = sum(n for _, n in counts)
    assert len(parts) == min(blocks, total)
    flat = [item.batch.num_tokens for part in parts for item in part for _ in range(item.count)]
    assert flat == [t for t, n in counts for _ in range(n)]  # every step once, in time order
    sizes = [sum(item.count for item in part) for part in parts]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(
    weights=st.dictionaries(st.integers(1, 60), st.floats(0.5, 50), min_size=1, max_size=10),
    width=st.sampled_from([0.0, 0.04, 0.2, 0.5]),
)
def test_smoothing_moves_weight_only_to_neighbours_and_keeps_it(weights, width):
    out = smoothed(weights, width, 60)
    assert abs(sum(out.values()) - sum(weights.values())) < 1e-6
    lo = min(max(1, t - int(width * t)) for t in weights)
    hi = max(min(60, t + int(width * t)) for t in weights)
    assert all(lo <= u <= hi for u in out)


def test_each_block_is_scored_by_sizes_fitted_without_it():
    blocks = [{4: 10.0}, {4: 10.0}, {9: 10.0}]
    seen = []

    def fit(weights):
        seen.append(dict(weights))
        return lambda k: sorted({*weights, 16})

    [score] = held_out_scores(blocks, 0.0, 16, fit, range(1, 2))
    assert seen == [{4: 10.0, 9: 10.0}, {4: 10.0, 9: 10.0}, {4: 20.0}]
    assert score == 0 + 0 + 10 * (16 - 9)  # the last block pads to 16: its 9 was never fitted


# One header line: any character YAML admits in a comment (no other control character, no
# surrogate or U+FFFE/U+FFFF), but no line end; NEL, LS and PS among them, which YAML breaks at.
_COMMENT_TEXT = st.text(
    st.characters(exclude_categories=("Cs", "Cc"), exclude_characters="\ufffe\uffff") | st.sampled_from("\t\x85"),
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(header=st.lists(_COMMENT_TEXT, max_size=4))
@example(header=["\x85", ""])  # NEL, which str.splitlines (not the user's editor) breaks a line at
@example(header=["a\u2028#b", "c"])  # LS: YAML breaks the line there too, so the rest is a comment
@example(header=["\u2029", ""])  # PS
def test_any_user_header_is_kept_and_the_written_spec_still_loads(tmp_path_factory, header):
    """Whatever the user's header comment holds (control characters, escapes), the spec optimize
    writes keeps it as comment lines and loads as the same spec."""
    from capplan.commands.traffic import optimized_spec_text, user_comment
    from capplan.loading import load_spec

    tmp = tmp_path_factory.mktemp("h")
    spec = tmp / "deploy.yaml"
    spec.write_text("".join(f"#{line}\n" for line in header) + SPEC, encoding="utf-8")
    try:
        loaded = load_spec(spec)
    except SpecError:
        assume(False)  # not a spec capplan reads (YAML refuses control characters even in comments)
    trace = [TraceBatch(Batch(n, n, 1), 10) for n in (1, 3, 7, 12)]
    result = optimize(loaded, trace, load_steps(), max_graphs=40)
    text = optimized_spec_text(spec, [tmp / "t.jsonl"], result)
    kept = user_comment(spec)
    assert kept in text and len(kept.splitlines()) == len(header)
    out = tmp / "o.yaml"
    out.write_text(text, encoding="utf-8")
    assert load_spec(out) == result.spec


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n"])
def test_the_header_of_a_spec_with_any_line_ending_is_its_comment_lines_only(tmp_path, newline):
    from capplan.commands.traffic import user_comment

    spec = tmp_path / "deploy.yaml"
    spec.write_bytes(newline.join(["# one", "# two", *SPEC.splitlines()]).encode())
    assert user_comment(spec) == "# one\n# two\n"


def test_other_traffic_the_choice_loses_on_keeps_the_specs_sizes_and_says_where(tmp_path):
    """Fitted on decodes of 1..8 tokens; other traffic of 120-token decodes pads far more under
    the fitted sizes than under vLLM's: the spec's own sizes are written, naming that trace."""
    spec, trace = _write(tmp_path, [_decodes(1 + i % 8, 5) for i in range(400)])
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(_decodes(120, 10)) + "\n" for _ in range(50)))
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps(_decodes(1 + i % 8, 5)) + "\n" for i in range(50)))
    out = tmp_path / "out.yaml"
    fitted = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o", str(out),
                                 "--judge-on", str(same), "--json"])  # fmt: skip
    assert fitted.exit_code == 0, fitted.output
    doc = json.loads(fitted.stdout)
    assert doc["kept_default"] is None and [j["trace"] for j in doc["judged_on"]] == [str(same)]
    assert doc["judged_on"][0]["padding"] <= doc["judged_on"][0]["default_padding"]
    kept = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o", str(tmp_path / "k.yaml"),
                               "--judge-on", str(same), "--judge-on", str(other)])  # fmt: skip
    assert kept.exit_code == 0, kept.output
    (reason,) = [line for line in kept.stderr.splitlines() + kept.stdout.splitlines() if line.startswith("kept:")]
    assert f"do worse than the spec's own on {other} (" in reason and "not fitted on): padding " in reason
    written = yaml.safe_load((tmp_path / "k.yaml").read_text())
    assert written["cudagraph"]["capture_sizes"] is None  # the spec's own: vLLM's sizes
    missing = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o",
                                  str(tmp_path / "m.yaml"), "--judge-on", str(tmp_path / "nope.jsonl")])  # fmt: skip
    assert missing.exit_code == 1 and "nope.jsonl: no such file" in missing.stderr
    assert not (tmp_path / "m.yaml").exists()


def test_many_steps_above_the_largest_graph_propose_a_larger_one(tmp_path):
    """30% of steps are 400-token prefills, above the largest graph (256 tokens, vLLM's ceiling
    for 128 sequences): optimize proposes the ceiling that covers 99% of steps, with vLLM's sizes
    up to it counted and simulated; the spec it writes is unchanged by the proposal."""
    prefill = {"num_reqs": 1, "num_tokens": 400, "max_query_len": 400, "count": 3}
    spec, trace = _write(tmp_path, [_decodes(1 + i % 8, 7) if i % 2 else prefill for i in range(200)])
    out = tmp_path / "out.yaml"
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    larger = json.loads(result.stdout)["raise_largest"]
    assert (larger["top"], larger["ceiling"], larger["eager"]) == (256, 400, 0)
    assert larger["above"] == 300 and larger["steps"] == 1000 and larger["graphs"] > larger["default_graphs"]
    assert (yaml.safe_load(out.read_text()).get("cudagraph") or {}).get("max_capture_size") is None
    text = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o", str(tmp_path / "t.yaml")])
    assert "raise the largest graph? 300 of 1000 steps (30.0%) are above it (256 tokens)" in text.output
    assert "with cudagraph.max_capture_size: 400 (99% of the steps are at most that)" in text.output
    spec.write_text(HEADER + SPEC + "cudagraph: {capture_sizes: [1, 2, 4, 8, 16, 32, 64, 128, 256]}\n")
    listed = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o", str(tmp_path / "l.yaml"),
                                 "--json"])  # fmt: skip
    assert listed.exit_code == 0 and json.loads(listed.stdout)["raise_largest"] is None  # sizes the spec lists
    spec.write_text(HEADER + SPEC + "cudagraph: {mode: FULL_DECODE_ONLY}\n")  # no mixed graph to raise
    decode_only = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-graphs", "20", "-o",
                                      str(tmp_path / "d.yaml"), "--json"])  # fmt: skip
    assert decode_only.exit_code == 0 and json.loads(decode_only.stdout)["raise_largest"] is None
