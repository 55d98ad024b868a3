"""Traces for any deployment: the example generator takes a deployment's limits (or a spec),
and --drop-unschedulable fits a recorded trace to a deployment, saying what it dropped."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.batches import batch_problem, parse_batch, read_batches
from capplan.cli import app
from capplan.planner.dispatch import beyond_spec
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
_spec = importlib.util.spec_from_file_location("example_make_traces", ROOT / "examples" / "traces" / "make_traces.py")
assert _spec is not None and _spec.loader is not None
make_traces = importlib.util.module_from_spec(_spec)
sys.modules["example_make_traces"] = make_traces
_spec.loader.exec_module(make_traces)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.integers(1, 300),
    extra_budget=st.integers(0, 9000),
    loras=st.integers(0, 10),
    model_len=st.integers(2, 40000),
)
def test_generated_traces_fit_any_deployments_limits(seqs, extra_budget, loras, model_len):
    limits = make_traces.Limits(seqs, seqs + extra_budget, loras, model_len)
    spec = make_spec(
        scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": seqs + extra_budget},
        lora={"enabled": loras > 0, "max_loras": max(1, loras)},
    )
    for _, fn, seed in make_traces.TRACES:
        steps = fn(random.Random(seed), limits, 300)
        assert len(steps) == 300
        for line in make_traces.render("x", steps, limits).splitlines()[1:]:
            batch = parse_batch(json.loads(line)).batch
            assert batch_problem(batch) is None and beyond_spec(batch, spec) is None, line
            assert batch.max_query_len <= model_len


def test_checked_in_traces_are_the_generators_output_in_run_order(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "traces" / "make_traces.py"), "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for name in ("chat", "bursty", "multitenant"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (
            ROOT / "examples" / "traces" / f"{name}.jsonl"
        ).read_bytes()
    # run order, not sorted by batch: the held-out last part is the run's last part
    tokens = [b.batch.num_tokens for b in read_batches(tmp_path / "chat.jsonl").batches]
    assert tokens != sorted(tokens)


def test_generator_for_a_spec_and_bad_limits(tmp_path):
    spec = tmp_path / "d.yaml"
    spec.write_text("scheduler: {max_num_seqs: 64, max_num_batched_tokens: 8192, max_model_len: 8192}\n"
                    "lora: {enabled: true, max_loras: 4}\n")  # fmt: skip
    script = str(ROOT / "examples" / "traces" / "make_traces.py")
    done = subprocess.run([sys.executable, script, "--spec", str(spec), "-o", str(tmp_path / "t")], capture_output=True)
    assert done.returncode == 0, done.stderr
    plan = tmp_path / "d.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    for name in ("chat", "bursty", "multitenant"):
        result = runner.invoke(app, ["simulate", str(plan), str(tmp_path / "t" / f"{name}.jsonl")])
        assert result.exit_code == 0, result.output
    bad = subprocess.run(
        [sys.executable, script, "--max-num-seqs", "0", "-o", str(tmp_path / "u")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "limits out of range" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "u").exists()


BATCH = st.builds(
    lambda reqs, extra, loras, count: {
        "num_reqs": reqs,
        "num_tokens": reqs + extra,
        "num_active_loras": min(loras, reqs),
        "count": count,
    },
    st.integers(1, 40),
    st.integers(0, 200),
    st.integers(0, 6),
    st.integers(1, 9),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(BATCH, min_size=1, max_size=12), seqs=st.integers(1, 40), loras=st.integers(1, 6))
def test_drop_unschedulable_leaves_out_exactly_what_the_deployment_never_schedules(tmp_path, rows, seqs, loras):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(
        f"scheduler: {{max_num_seqs: {seqs}, max_num_batched_tokens: 256}}\n"
        f"lora: {{enabled: true, max_loras: {loras}}}\n"
    )
    plan = tmp_path / "s.plan.yaml"
    assert runner.invoke(app, ["compile", str(spec_path), "-o", str(plan)]).exit_code == 0
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = make_spec(
        scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": 256}, lora={"enabled": True, "max_loras": loras}
    )
    whole = read_batches(trace).batches
    beyond = sum(b.count for b in whole if beyond_spec(b.batch, spec))
    total = sum(b.count for b in whole)
    refused = runner.invoke(app, ["simulate", str(plan), str(trace), "--json"])
    fitted = runner.invoke(app, ["simulate", str(plan), str(trace), "--json", "--drop-unschedulable"])
    if not beyond:
        assert refused.exit_code == 0 and fitted.exit_code == 0 and "dropped" not in fitted.stderr
        return
    assert refused.exit_code == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "--drop-unschedulable" in refused.stderr and "Traceback" not in refused.output
    if beyond == total:
        assert fitted.exit_code == 1 and len(fitted.stderr.strip().splitlines()) == 1
        assert "holds no batch this deployment schedules" in fitted.stderr
        return
    assert fitted.exit_code == 0, fitted.output
    assert json.loads(fitted.stdout)["steps"] == total - beyond
    [note] = fitted.stderr.strip().splitlines()
    assert f"dropped {beyond} of {total} steps" in note


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.integers(-3, 300),
    budget=st.integers(-3, 9000),
    loras=st.integers(-3, 10),
    model_len=st.integers(-3, 40000),
)
def test_generator_limits_out_of_range_are_one_line_and_write_nothing(tmp_path_factory, seqs, budget, loras, model_len):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("g") / "traces"
    argv = ["--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(budget), "--max-loras", str(loras)]
    argv += ["--max-model-len", str(model_len), "-o", str(out)]
    bad = seqs < 1 or budget < seqs or loras < 0 or model_len < 2
    if not bad:
        return  # the valid ones: test_generated_traces_fit_any_deployments_limits
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        make_traces.main(argv)
    assert "limits out of range" in err.getvalue() and "Traceback" not in err.getvalue()
    assert not out.exists()
