"""Inputs that fail closed: a calibration checked only against what decides (tensor-parallel
size among it), launch-line JSON and integers without tracebacks, a report path naming a FIFO
refused without waiting, the ready tier's words and limits, dispatch of a deferred graph, and
generated launch lines and plan-file values (Hypothesis)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.calibration.identity import judge
from capplan.cli import app
from capplan.present.verify import violation_message
from capplan.traffic.steps import DEFAULT_CALIBRATION
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"
SERVED = ROOT / "examples" / "served"
runner = CliRunner()
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# The packaged calibration's identity, as a spec would name the same deployment.
SAME = {
    "model": {"name": "llama0.9b", "architecture": "LlamaForCausalLM", "parameters": 852_559_872, "dtype": "bfloat16"},
    "target": {"gpu": "NVIDIA H200"},
    "parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
}


def _packaged():
    from capplan.loading import load_calibration

    return load_calibration(DEFAULT_CALIBRATION)


def _note(**sections) -> tuple[bool, str]:
    basis = judge(_packaged(), make_spec(**sections))
    return basis.usable, basis.note


def _one_error_line(result) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# -- identities: "checked" only when every deciding field was compared ------------------------


def test_the_same_deployment_named_in_full_is_checked():
    usable, note = _note(**SAME)
    assert usable and "not checked" not in note and "TP 1 PP 1" in note


@pytest.mark.parametrize(
    "model",
    [{"architecture": "LlamaForCausalLM"}, {"dtype": "bfloat16"}, {"hidden_size": 2048}],
    ids=["architecture only", "dtype only", "hidden_size only"],
)
def test_a_model_named_by_one_field_is_not_checked(model):
    usable, note = _note(**{**SAME, "model": model})
    assert usable and "not checked" in note and "no model name, or architecture and parameters" in note


def test_a_calibration_naming_only_its_model_against_a_spec_of_architecture_and_size():
    from capplan.schemas.calibration import Calibration

    cal = Calibration(
        name="x",
        identity={
            "model": {"name": "my-llama"},
            "gpu": "NVIDIA H200",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        },
    )
    spec = make_spec(**{**SAME, "model": {"architecture": "LlamaForCausalLM", "parameters": 852_559_872}})
    basis = judge(cal, spec)
    assert "not checked" in basis.note and "no model name, or architecture and parameters" in basis.note


def test_tensor_parallel_size_is_compared():
    usable, note = _note(**{**SAME, "parallel": {"tensor_parallel_size": 8, "pipeline_parallel_size": 1}})
    assert not usable and "tensor_parallel_size 1 vs 8" in note
    usable, note = _note(**{**SAME, "parallel": {}})
    assert usable and "the spec does not give parallel.tensor_parallel_size, parallel.pipeline_parallel_size" in note


TOY = Path(__file__).resolve().parents[1] / "src" / "capplan" / "data" / "h200-vllm025.yaml"


def test_optimize_says_what_its_budget_rests_on(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"model": {"architecture": "LlamaForCausalLM"}}))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"num_reqs": n, "num_tokens": n}) + "\n" for n in (1, 8, 64, 200)))
    result = runner.invoke(
        app, ["optimize", str(spec), str(trace), "--max-capture-seconds", "30", "--calibration", str(TOY),
              "-o", str(tmp_path / "o.yaml")]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "not checked against this deployment" in result.output
    # without a calibration no capture is priced: the budget is refused, saying what would price it
    bare = runner.invoke(app, ["optimize", str(spec), str(trace), "--max-capture-seconds", "30", "-o",
                               str(tmp_path / "b.yaml")])  # fmt: skip
    assert bare.exit_code == 2 and "capplan calibrate" in bare.output and not (tmp_path / "b.yaml").exists()


def _traced(tmp_path: Path, layout: str) -> Path:
    trace = tmp_path / "trace.jsonl"
    lines = (SERVED / "trace-a.jsonl").read_text().splitlines(True)
    trace.write_text(lines[0].rstrip("\n") + layout + "\n" + "".join(lines[1:]))
    return trace


def test_calibrate_trace_records_the_traces_own_parallel_sizes(tmp_path):
    base = SERVED / "h200-vllm0.25.1-llama0.9b.yaml"  # measured at TP 1
    args = ["calibrate-trace", str(SERVED / "llama0.9b.plan.yaml")]
    tp8 = _traced(tmp_path, "; tensor_parallel_size 8; pipeline_parallel_size 1")
    out = tmp_path / "out.yaml"
    refused = runner.invoke(app, [*args, str(tp8), "--calibration", str(base), "-o", str(out)])
    assert refused.exit_code == 1 and "tensor_parallel_size 1 vs 8" in _one_error_line(refused)
    assert not out.exists()
    alone = runner.invoke(app, [*args, str(tp8), "-o", str(out)])
    assert alone.exit_code == 0, alone.output
    assert yaml.safe_load(out.read_text())["identity"]["tensor_parallel_size"] == 8
    tp1 = _traced(tmp_path, "; tensor_parallel_size 1; pipeline_parallel_size 1")
    out.unlink()
    merged = runner.invoke(app, [*args, str(tp1), "--calibration", str(base), "-o", str(out)])
    assert merged.exit_code == 0, merged.output
    identity = yaml.safe_load(out.read_text())["identity"]
    assert identity["tensor_parallel_size"] == 1 and identity["pipeline_parallel_size"] == 1
    out.unlink()
    unsaid = runner.invoke(app, [*args, str(SERVED / "trace-a.jsonl"), "--calibration", str(base), "-o", str(out)])
    assert unsaid.exit_code == 0
    assert "tensor_parallel_size" not in yaml.safe_load(out.read_text())["identity"]  # never the base's


# -- launch lines: bounded and typed --------------------------------------------------------

DEEP = '{"a":' * 3000 + "1" + "}" * 3000
LAUNCHES = {
    "deep -cc JSON": ["-cc", DEEP],
    "deep -sc JSON": ["-sc", DEEP],
    "deep dotted key": ["-cc.a" + ".b" * 3000 + "=1"],
    "deep dotted value": ["-cc.cudagraph_capture_sizes=" + "[" * 3000 + "]" * 3000],
    "400-digit k": ["--max-num-batched-tokens", "9" * 400 + "k"],
    "400-digit JSON integer": ["-cc", '{"max_cudagraph_capture_size": ' + "9" * 400 + "}"],
    "sizes mixing ints and strings": ["-cc", '{"cudagraph_capture_sizes": [1, "a"]}'],
    "sizes holding a list": ["-cc", '{"cudagraph_capture_sizes": [1, [2]]}'],
    "sizes holding a null": ["-cc.cudagraph_capture_sizes=[1,null]"],
    "budgets mixing types": ["-cc", '{"encoder_cudagraph_token_budgets": [64, "x"]}'],
    "speculative tokens as a string": ["-sc", '{"num_speculative_tokens": "2"}'],
}


@pytest.mark.parametrize("extra", LAUNCHES.values(), ids=LAUNCHES.keys())
def test_launch_lines_fail_closed_in_one_line(extra):
    result = runner.invoke(
        app, ["apply", "--runner", "mrv2", "--dry-run", str(PLAN), "--", "vllm", "serve", "M", *extra]
    )
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert len(line) < 300


FLAGS = ["--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--max-loras", "-dp", "-tp", "-pp",
         "--max-cudagraph-capture-size", "--enable-lora", "--no-enable-lora", "--enforce-eager",
         "--cudagraph-capture-sizes", "-cc", "-sc", "--compilation-config", "-cc.cudagraph_mode",
         "-cc.cudagraph_capture_sizes", "-cc.max_cudagraph_capture_size", "-sc.num_speculative_tokens",
         "--config", "--port"]  # fmt: skip
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=30), inner, max_size=3)),
    max_leaves=12,
)
VALUES = st.one_of(
    st.sampled_from(["32", "4k", "1K", "auto", "-1", "FULL", "2", "true", "[1,2]", "", "9" * 60 + "k"]),
    JSON_VALUES.map(json.dumps),
    st.builds(lambda d: json.dumps({"cudagraph_capture_sizes": d}), JSON_VALUES),
    st.text(max_size=20),
)


@SETTINGS
@given(
    tokens=st.lists(
        st.tuples(st.sampled_from(FLAGS), st.one_of(st.none(), VALUES), st.booleans()), min_size=1, max_size=5
    )
)
def test_generated_launch_lines_fail_closed(tokens):
    argv = []
    for flag, value, inline in tokens:
        if value is None:
            argv.append(flag)
        elif inline:
            argv.append(f"{flag}={value}")
        else:
            argv += [flag, value]
    result = runner.invoke(
        app, ["apply", "--runner", "mrv2", "--dry-run", str(PLAN), "--", "vllm", "serve", "M", *argv]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code:
        _one_error_line(result)


# -- plan files: every value's type ------------------------------------------------------------


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            yield from _paths(v, (*path, i))


PLAN_DATA = yaml.safe_load(PLAN.read_text())
PLAN_PATHS = [p for p in _paths(PLAN_DATA) if p]
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(
        st.one_of(st.integers(0, 99), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2)), max_size=4
    ),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PLAN_PATHS), value=ODD)
def test_plan_files_with_a_value_of_another_type_fail_closed(tmp_path_factory, path, value):
    import copy

    data = copy.deepcopy(PLAN_DATA)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    folder = tmp_path_factory.mktemp("plan")
    target = folder / "p.plan.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    for args in (["verify", str(target)], ["show", str(target), "--json"], ["diff", str(PLAN), str(target)]):
        result = runner.invoke(app, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
        if result.exit_code not in (0, 2):
            _one_error_line(result)


# -- writers and environment variables that must never wait ---------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_report_or_trace_path_naming_a_fifo_is_refused_without_waiting(tmp_path, monkeypatch):
    from capplan.loading import spec_from_data
    from capplan.planner import compile_plan
    from capplan.runtime.recorder import _is_trace
    from capplan.runtime.report import Report

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("CAPPLAN_REPORT", str(fifo))
    report = Report(compile_plan(spec_from_data({}, "s")), "p.plan.yaml")
    report._finished = True  # nothing to print at exit
    answers: list[object] = []
    worker = threading.Thread(target=lambda: answers.extend([report._owns(str(fifo)), _is_trace(str(fifo))]))
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "opening the FIFO waited for a reader"
    assert answers == [False, False]


def test_llm_args_variable_is_read_like_the_other_readers(monkeypatch):
    from capplan.errors import CapplanError
    from capplan.offline.smoke import env_llm_args

    for value in ("[" * 5000 + "]" * 5000, "not json", "[1]", '{"tensor_parallel_size": "8"}', '{"a": 1, "a": 2}'):
        monkeypatch.setenv("CAPPLAN_SMOKE_LLM_ARGS", value)
        with pytest.raises(CapplanError, match="CAPPLAN_SMOKE_LLM_ARGS"):
            env_llm_args()
    monkeypatch.setenv("CAPPLAN_SMOKE_LLM_ARGS", '{"max_model_len": 512}')
    assert env_llm_args() == {"max_model_len": 512}


# -- tiers: words and limits ---------------------------------------------------------------


def test_ready_share_refuses_speculative_decoding_in_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"speculative": {"num_speculative_tokens": 2}}))
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"num_reqs": 4, "num_tokens": 4}) + "\n")
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--ready-share", "0.5"])
    assert result.exit_code == 2
    assert "--ready-share: deferred capture does not support speculative decoding" in _one_error_line(result)


def test_ready_share_is_reported_as_asked(tmp_path):
    spec = tmp_path / "s.yaml"
    shutil.copy(SERVED / "llama0.9b.yaml", spec)
    out = tmp_path / "o.yaml"
    result = runner.invoke(
        app, ["optimize", str(spec), str(SERVED / "trace-a.jsonl"), "--ready-share", "0.999", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "asked 99.9%" in result.output


def test_dispatch_says_when_its_graph_is_deferred(tmp_path):
    plan = ROOT / "examples" / "h200-tiny-llama-025-tiers.plan.yaml"
    result = runner.invoke(app, ["dispatch", str(plan), "--reqs", "3", "--tokens", "17", "--loras", "2"])
    assert result.exit_code == 0
    assert "deferred: captured while the engine serves; until then this batch replays PIECEWISE:32@2" in result.stdout
    ready = runner.invoke(app, ["dispatch", str(plan), "--reqs", "4", "--tokens", "4"])
    assert "deferred" not in ready.stdout


def test_a_multimodal_spec_error_names_the_spec_file(tmp_path):
    spec = tmp_path / "vl.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "target": {"vllm": "0.33"},
                "multimodal": {
                    "encoder_cudagraphs": True,
                    "token_budgets": [64, 128],
                    "max_vision_items_per_batch": 100,
                },
            }
        )
    )
    result = runner.invoke(app, ["compile", str(spec), "--dry-run"])
    assert result.exit_code == 1
    assert _one_error_line(result).startswith(f"error: {spec}: multimodal: max_vision_items_per_batch (100)")


def test_verify_names_each_stand_in_that_cannot_replay_a_deferred_graph():
    """The chain summary judges a deferred graph against every later graph of its chain at
    once; a chain that fails is still reported graph by graph."""
    from capplan.analysis.verify import verify_plan
    from capplan.planfile import load_plan

    plan = load_plan(ROOT / "examples" / "h200-tiny-llama-025-tiers.plan.yaml")
    assert plan.tiers is not None
    gid = plan.tiers.deferred[0]
    other = next(
        g.id for g in plan.graphs if g.descriptor.cg_mode != plan.graphs[gid].descriptor.cg_mode
    )  # a graph of another mode cannot stand in
    fallback = {**plan.tiers.fallback, gid: other}
    broken = plan.model_copy(update={"tiers": plan.tiers.model_copy(update={"fallback": fallback})})
    messages = [violation_message(v) for v in verify_plan(broken, consistency=False).violations]
    assert any("which cannot replay its batches" in m for m in messages), messages


# -- the plain-document loader: the same data as the full loader, or it steps aside ----------

KEYS = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.booleans(), st.none())
DOCS = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10),
        st.sampled_from(["0256", "1:00", "0x1F", "1_000", "yes", "on", "~", ".inf", "-.NaN", "2026-12-01", "'q'"]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    doc=DOCS,
    flow=st.booleans(),
    edit=st.tuples(
        st.integers(0, 400),
        st.sampled_from(
            [
                "",
                ":",
                "-",
                "&a ",
                "*a",
                "!!str ",
                "\n",
                "{",
                "'",
                "  x: 1\n",
                "x: 1\n",
                "True",
                "NULL",
                " 1e3",
                "+1",
                "-0",
                ".5",
                "y: FALSE\n",
            ]
        ),
    ),
)
def test_the_plain_document_path_reads_as_the_full_loader_or_steps_aside(doc, flow, edit):
    import yaml as pyyaml

    from capplan.files import _Loader, _plain_document

    text = pyyaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True)
    at, insert = edit
    text = text[:at] + insert + text[at:]
    try:
        full: object = ("ok", pyyaml.load(text, Loader=_Loader))  # noqa: S506 - capplan's safe loader
    except (pyyaml.YAMLError, RecursionError) as exc:
        full = ("error", type(exc).__name__)
    plain, data = _plain_document(text)
    if plain:
        assert full[0] == "ok" and _same(full[1], data), (text, full, data)


def _same(a: object, b: object) -> bool:
    """Equal, types included (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    return a == b


SPELLINGS = ["True", "true", "TRUE", "False", "FALSE", "null", "Null", "NULL", "~", "", "1", "+1", "-0", "007", "1e3",
             ".5", "1.0e+3", ".inf", "-.Inf", ".NaN", "0x1F", "1_000", "1:00", "yes", "no", "'q'", '"q"', "2026-12-01",
             "3.14", "-12", "9" * 40, "[1, x]", "{a: 1}", "a b", "k: v"]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from(SPELLINGS), min_size=1, max_size=6), as_list=st.booleans())
def test_every_scalar_spelling_reads_as_the_full_loader_reads_it(tokens, as_list):
    import yaml as pyyaml

    from capplan.files import _Loader, _plain_document

    text = "".join(f"- {t}\n" if as_list else f"k{i}: {t}\n" for i, t in enumerate(tokens))
    try:
        full: object = ("ok", pyyaml.load(text, Loader=_Loader))  # noqa: S506 - capplan's safe loader
    except pyyaml.YAMLError:
        full = ("error",)
    plain, data = _plain_document(text)
    if plain:
        assert full[0] == "ok" and _same(full[1], data), (text, full, data)


def test_tiers_under_tensor_and_pipeline_parallelism_compile_and_launch():
    """Tensor and pipeline parallel engines defer graphs (every capture on the idle turns, which
    reach every rank at once): compile keeps the tiers, and the dry run passes -tp and -pp."""
    from capplan.loading import spec_from_data
    from capplan.planner import compile_plan

    spec = spec_from_data(
        {
            "target": {"vllm": "0.29.0"},
            "parallel": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
            "tiers": {"ready": "full_decode"},
        },
        "s",
    )
    plan = compile_plan(spec)
    assert plan.tiers is not None and plan.tiers.deferred
    tiered = ROOT / "examples" / "h200-tiny-llama-025-tiers.plan.yaml"
    for flags in (["-tp", "2"], ["-pp", "2"]):
        result = runner.invoke(
            app, ["apply", "--runner", "mrv2", "--dry-run", str(tiered), "--", "vllm", "serve", "M", *flags]
        )
        assert result.exit_code == 0, result.output
        assert " ".join(flags) in result.stdout


def test_the_lora_rank_is_compared_where_the_spec_gives_one():
    from capplan.schemas.calibration import Calibration

    ident = {"model": {"name": "my-llama", "dtype": "bfloat16"}, "gpu": "NVIDIA H200", "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1}  # fmt: skip
    spec_of = lambda rank: make_spec(  # noqa: E731
        model={"name": "my-llama", "dtype": "bfloat16"},
        target={"vllm": "0.33", "gpu": "NVIDIA H200"},
        parallel={"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
        lora={"enabled": True, "max_loras": 4, **({"max_lora_rank": rank} if rank else {})},
    )
    sixteen = Calibration(name="x", identity={**ident, "lora_rank": 16})
    same = judge(sixteen, spec_of(16))
    assert same.usable and "not checked" not in same.note and "differs" not in same.note
    other = judge(sixteen, spec_of(64))
    assert not other.usable and "LoRA rank 16 vs 64" in other.note
    unrecorded = judge(Calibration(name="x", identity=ident), spec_of(64))
    assert unrecorded.usable and "the calibration does not record lora_rank" in unrecorded.note
    assert "lora_rank" not in judge(sixteen, spec_of(None)).note  # a spec that gives none: compared on the rest
