"""Calibrations from start reports, the shape model, and diffs priced by them."""

import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.calibration.price import fit_shape_model, project_calibrations
from capplan.calibration.shape import shape_from_config
from capplan.calibration.starts import read_report
from capplan.cli import app
from capplan.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "capplan" / "data"
RESULTS = "tests/gpu/results"
runner = CliRunner()


def _gpu_specs():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from release_run import MAIN
    from release_run import SPEC as TINY
    from served_loop import SPEC as BIG

    return BIG.replace('vllm: "0.25"', 'vllm: "0.33.0"'), TINY.format(release="0.33.0", max_loras=3, **MAIN)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The plans of the kept 0.33.0 starts, compiled again from the GPU runs' specs."""
    work = tmp_path_factory.mktemp("plans")
    big, tiny = _gpu_specs()
    out = {}
    for name, text in (("big", big), ("tiny", tiny)):
        (work / f"{name}.yaml").write_text(text)
        assert runner.invoke(app, ["compile", str(work / f"{name}.yaml")]).exit_code == 0
        out[name] = work / f"{name}.plan.yaml"
    return out


BIG_REPORTS = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / RESULTS / "deferred" / "0.33.0").glob("**/starts/**/*full.report.json")
)
TINY_REPORTS = [
    f"{RESULTS}/releases/0.33.0/serve/planned.report.json",
    f"{RESULTS}/registry/0.33.0/planned.report.json",
]


def _calibrate(args, out):
    return runner.invoke(app, ["calibrate-start", *args, "-o", str(out)])


PRODUCTION = f"{RESULTS}/production/0.33.0-h100"
PRODUCTION_REPORTS = [f"{PRODUCTION}/start{i}-full.report.json" for i in (0, 4, 5)]
H200 = ["--gpu", "NVIDIA H200", "--vllm", "0.33.0", "--lora-rank", "8"]
PROBES = f"{RESULTS}/calibration/0.33.0-h100/probes"  # probes of plan A, first-capture starts of A and B
_PROBE, _A, _B = "probe.calibration.report.json", "startA.report.json", "startB.report.json"
PROBED = [("llama-3.1-8b", "llama3.1-8b", [_A, _B, _PROBE]), ("llama-3.2-1b", "llama3.2-1b", [_A, _B, _PROBE]),
          ("qwen2.5-14b", "qwen2.5-14b", [_B, _PROBE]), ("olmoe-1b-7b", "olmoe-1b-7b", [_B, _PROBE])]  # fmt: skip
INSIDE = f"{RESULTS}/calibration/0.33.0-h100/inside"  # probes read inside vLLM's one capture, beside a start of A
INSIDE_RUNS = [("llama-3.1-8b", "llama3.1-8b", [_A, _PROBE, "probe-warm.calibration.report.json"]),
               ("llama-3.2-1b", "llama3.2-1b", [_A, _PROBE])]  # fmt: skip
HELDOUT = f"{RESULTS}/calibration/0.33.0-h100/heldout"  # the held-out round: a probe of A, a start of B
HELDOUT_RUNS = [("llama-3.1-8b", "llama3.1-8b"), ("qwen2.5-7b", "qwen2.5-7b")]


@pytest.mark.parametrize(
    "name, reports, plan, config, extra",
    [
        ("h200-vllm033-llama0.9b", BIG_REPORTS, "big", "src/capplan/data/models/llama0.9b.config.json",
         ["--model", "llama0.9b", *H200, "--attention-backend", "TRITON_ATTN"]),
        ("h200-vllm033-tiny-llama", TINY_REPORTS, "tiny", "src/capplan/data/models/tiny-llama.config.json",
         ["--model", "tiny-llama", *H200]),
        ("h100-vllm033-llama3.1-8b", PRODUCTION_REPORTS, f"{PRODUCTION}/full.plan.yaml",
         "tests/gpu/configs/llama-3.1-8b.json",
         ["--model", "llama3.1-8b", "--gpu", "NVIDIA H100 80GB HBM3", "--vllm", "0.33.0", "--torch", "2.11.0+cu130",
          "--attention-backend", "FLASH_ATTN", "--lora-rank", "16"]),
        *[(f"h100-vllm033-{tag}-probe", [f"{PROBES}/{shape}-{r}" for r in reports], [f"{PROBES}/planA.plan.yaml",
           f"{PROBES}/planB.plan.yaml"], f"tests/gpu/configs/{shape}.json", []) for shape, tag, reports in PROBED],
        *[(f"h100-vllm033-{tag}-inside", [f"{INSIDE}/{shape}-{r}" for r in reports], f"{INSIDE}/planA.plan.yaml",
           f"tests/gpu/configs/{shape}.json", []) for shape, tag, reports in INSIDE_RUNS],
        *[(f"h100-vllm033-{tag}-heldout", [f"{HELDOUT}/{shape}-{r}" for r in (_PROBE, _B)],
           [f"{HELDOUT}/planA.plan.yaml", f"{HELDOUT}/planB.plan.yaml"], f"tests/gpu/configs/{shape}.json", [])
          for shape, tag in HELDOUT_RUNS],
    ],
)  # fmt: skip
def test_the_shipped_calibrations_are_what_the_kept_reports_give(
    plans, tmp_path, monkeypatch, name, reports, plan, config, extra
):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "cal.yaml"
    plan_args = [a for p in (plan if isinstance(plan, list) else [plan]) for a in ("--plan", str(plans.get(p, p)))]
    result = _calibrate([*reports, *plan_args, "--model-config", config, "--name", name, *extra], out)
    assert result.exit_code == 0, result.output
    made = yaml.safe_load(out.read_text())
    shipped = yaml.safe_load((DATA / "calibrations" / f"{name}.yaml").read_text())
    assert made == shipped
    assert len(made["starts"]) == len(reports) and (
        made["identity"]["given"] or name.endswith(("probe", "inside", "heldout"))
    )
    assert oct(out.stat().st_mode & 0o777) == "0o644"


def _refused(args, out, says):
    result = _calibrate(args, out)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert says in result.stderr
    assert not out.exists()


def test_a_report_of_another_plan_release_or_start_kind_is_refused_with_the_reason(plans, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "cal.yaml"
    tiny = ["--plan", str(plans["tiny"])]
    _refused([f"{RESULTS}/registry/0.33.0/dummy.report.json", *tiny], out, "a start of another plan")
    _refused([f"{RESULTS}/deferred/0.33.0/check/full.report.json", *tiny], out, "did not fall across capture")
    _refused([f"{RESULTS}/deferred/0.33.0/step-budget/check/tiers.report.json", *tiny], out, "deferred capture")
    _refused([TINY_REPORTS[0], *tiny, "--vllm", "0.29.0"], out, "a start of another release")
    _refused([TINY_REPORTS[0], TINY_REPORTS[0], *tiny], out, "given twice")
    # One bad report among good ones: nothing written.
    _refused([*TINY_REPORTS, f"{RESULTS}/registry/0.33.0/dummy.report.json", *tiny], out, "another plan")


def test_a_diff_of_the_tiny_model_s_plan_gets_its_measured_numbers(plans, tmp_path, monkeypatch):
    """A spec naming the tiny model of the kept reports, with its calibration in the folder
    beside the plans: the plan those starts ran is measured (their interval), another scaled."""
    _, tiny = _gpu_specs()
    monkeypatch.chdir(tmp_path)
    named = tiny.replace(
        'target: {runner: mrv2, vllm: "0.33.0"}',
        'target: {runner: mrv2, vllm: "0.33.0", gpu: NVIDIA H200}\n'
        "model: {name: tiny-llama, hidden_size: 256, num_layers: 2, dtype: bfloat16}\n"
        "parallel: {tensor_parallel_size: 1, pipeline_parallel_size: 1}",
    )
    Path("old.yaml").write_text(named)
    Path("new.yaml").write_text(named.replace("max_loras: 3", "max_loras: 4"))
    Path(".capplan/calibration").mkdir(parents=True)
    (tmp_path / ".capplan/calibration/tiny.yaml").write_text(
        (DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml").read_text()
    )
    data = json.loads(runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "json"]).stdout)
    old, new = data["price"]["old"], data["price"]["new"]
    assert old["kind"] == "measured" and new["kind"] == "scaled"
    reports = [yaml.safe_load(open(ROOT / r))["capture_seconds"] for r in TINY_REPORTS]
    assert old["capture_seconds"]["lo"] == round(min(reports), 2) and old["capture_seconds"]["hi"] == round(
        max(reports), 2
    )
    assert "registry/0.33.0/planned.report.json" in old["basis"]
    # seconds scaled without a probe's per-capture seconds: no interval, and said
    assert data["price"]["delta"]["capture_seconds"]["lo"] is None and new["capture_seconds"]["hi"] is None
    assert any("without a probe's per-capture seconds: no interval" in n for n in new["notes"])
    text = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml"]).stdout
    assert "(measured / scaled)" in text.splitlines()[0]


def test_an_8b_llama_on_an_h100_is_predicted_from_its_measured_shape_and_a_70b_is_extrapolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = (
        'target: {runner: mrv2, vllm: "0.33", gpu: NVIDIA H100}\n'
        "model: {name: meta-llama/Llama-3.1-8B-Instruct, hidden_size: 4096, num_layers: 32, dtype: bfloat16}\n"
        "scheduler: {max_num_seqs: 64, max_num_batched_tokens: 8192, max_model_len: 8192}\n"
        "lora: {enabled: true, max_loras: 4, specialize: true}\n"
    )
    Path("old.yaml").write_text(spec)
    Path("new.yaml").write_text(spec.replace("max_num_seqs: 64", "max_num_seqs: 128"))
    result = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml"])
    head = result.stdout.splitlines()[0]
    assert "GiB graph memory (predicted); 256 batch shape(s) go from eager to a graph" in head, head
    # the 8B shape's H100 starts are in the fit: its layers, hidden size and GPU are measured ones
    assert "32 layers, hidden 4096 on NVIDIA H100 80GB HBM3" in result.stdout
    assert "extrapolated: layers" not in result.stdout and "extrapolated: GPU" not in result.stdout
    seventy = spec.replace("hidden_size: 4096, num_layers: 32", "hidden_size: 8192, num_layers: 80")
    Path("old70.yaml").write_text(seventy)
    Path("new70.yaml").write_text(seventy.replace("max_num_seqs: 64", "max_num_seqs: 128"))
    far = runner.invoke(app, ["diff", "--spec", "old70.yaml", "new70.yaml"]).stdout
    assert "extrapolated: layers 80, 1.7x the largest measured (48)" in far
    h100_pcie = spec.replace("gpu: NVIDIA H100}", "gpu: NVIDIA H100 PCIe}")
    Path("pcie.yaml").write_text(h100_pcie)
    Path("pcie-new.yaml").write_text(h100_pcie.replace("max_num_seqs: 64", "max_num_seqs: 128"))
    other = runner.invoke(app, ["diff", "--spec", "pcie.yaml", "pcie-new.yaml"]).stdout
    assert "extrapolated: GPU NVIDIA H100 PCIe not measured" in other
    data = json.loads(runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "json"]).stdout)
    delta = data["price"]["delta"]["capture_seconds"]
    assert delta["lo"] < delta["value"] < delta["hi"]


def test_the_shape_model_s_held_out_errors_are_the_ones_the_benchmarks_state():
    model = fit_shape_model(project_calibrations())
    assert model is not None and len(model.held) == len(model.held_out) == len(project_calibrations()) == 11
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for h in model.held_out:
        gib = "-" if h.gib_error is None else f"{100 * h.gib_error:+.0f}%"
        row = f"| {h.name} | {100 * h.seconds_error:+.0f}% | {gib} |"
        assert row.replace("+-0%", "+0%").replace("-0%", "+0%") in doc, row


# -- bad input to every new reader: one line, nothing written ---------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=6),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"fingerprint": st.text(max_size=80), "graphs_planned": st.integers(-5, 10**6),
             "graphs_captured": st.one_of(st.integers(-5, 10**6), st.text(max_size=4), st.booleans()),
             "capture_seconds": st.one_of(st.floats(), st.integers(), st.none()),
             "graph_memory_gib": st.one_of(st.floats(), st.none(), st.text(max_size=3))},
        ).map(lambda v: json.dumps(v).encode()),
    )
)  # fmt: skip
def test_a_bad_report_is_one_line(tmp_path, body):
    path = tmp_path / "r.json"
    path.write_bytes(body)
    try:
        read_report(path)
    except InputError as exc:
        assert "\n" not in exc.message and exc.message.startswith(str(path))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from(["num_hidden_layers", "hidden_size", "intermediate_size", "torch_dtype", "text_config",
                             "num_local_experts", "vocab_size"]),
            st.one_of(st.integers(-3, 1 << 30), st.booleans(), st.text(max_size=5), st.floats(), st.none(),
                      st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)),
        ).map(lambda v: json.dumps(v).encode()),
    )
)  # fmt: skip
def test_a_bad_config_json_is_one_line(tmp_path, body):
    path = tmp_path / "config.json"
    path.write_bytes(body)
    try:
        shape = shape_from_config(path)
    except InputError as exc:
        assert "\n" not in exc.message and exc.message.startswith(str(path))
    else:
        assert shape.num_layers >= 1 and shape.hidden_size >= 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=120), st.text(max_size=120).map(str.encode)))
def test_a_bad_calibration_folder_or_config_is_one_line_and_writes_nothing(tmp_path_factory, body):
    """A calibration folder beside the plans with a bad file, and a bad --model-config to
    calibrate-start: exit 1 with one line, no traceback, nothing written."""
    work = tmp_path_factory.mktemp("w")
    _, tiny = _gpu_specs()
    (work / "old.yaml").write_text(tiny)
    (work / "new.yaml").write_text(tiny.replace("max_loras: 3", "max_loras: 4"))
    (work / ".capplan/calibration").mkdir(parents=True)
    (work / ".capplan/calibration/bad.yaml").write_bytes(body)
    result = runner.invoke(app, ["diff", "--spec", str(work / "old.yaml"), str(work / "new.yaml")])
    if result.exit_code not in (0, 2):
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (work / "config.json").write_bytes(body)
    out = work / "cal.yaml"
    made = _calibrate(
        [str(ROOT / TINY_REPORTS[0]), "--plan", str(work / "old.yaml"), "--model-config", str(work / "config.json")],
        out,
    )
    assert made.exit_code == 1 and "Traceback" not in made.output and not out.exists()
    assert len(made.stderr.strip().splitlines()) == 1, made.stderr


def _tiny_named():
    _, tiny = _gpu_specs()
    return tiny.replace(
        'target: {runner: mrv2, vllm: "0.33.0"}',
        'target: {runner: mrv2, vllm: "0.33.0", gpu: NVIDIA H200}\n'
        "model: {name: tiny-llama, hidden_size: 256, num_layers: 2, dtype: bfloat16}\n"
        "parallel: {tensor_parallel_size: 1, pipeline_parallel_size: 1}",
    )


def test_show_gives_the_graph_memory_to_leave_free_only_where_measured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(_tiny_named())
    assert runner.invoke(app, ["compile", "tiny.yaml"]).exit_code == 0
    shipped = DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml"
    # The kept starts captured after vLLM's profiling pass: their reading is no reserve.
    after = json.loads(runner.invoke(app, ["show", "tiny.plan.yaml", "--json", "--calibration", str(shipped)]).stdout)
    assert after["price"]["kind"] == "measured" and after["price"]["graph_memory_reserve_bytes"] is None
    text = runner.invoke(app, ["show", "tiny.plan.yaml", "--calibration", str(shipped)]).stdout
    assert "graph memory no reserve: not every start of this plan ran its capture first" in text
    cal = _first_capture(shipped, tmp_path / "first.yaml")
    data = json.loads(runner.invoke(app, ["show", "tiny.plan.yaml", "--json", "--calibration", str(cal)]).stdout)
    price = data["price"]
    assert price["kind"] == "measured"
    hi = math.ceil((price["graph_memory_gib"]["hi"] + 0.00005) * 2**30)  # the reading's rounding, taken up
    assert price["graph_memory_reserve_bytes"] == hi + max(round(hi * 0.005), 4 * 2**20)  # 0.5%, at least 4 MiB
    text = runner.invoke(app, ["show", "tiny.plan.yaml", "--calibration", str(cal)]).stdout
    assert "graph memory to leave free beside the KV cache" in text
    # Another model: only predicted, and vLLM's estimator stays in charge.
    Path("big.yaml").write_text(
        _tiny_named().replace("hidden_size: 256, num_layers: 2", "hidden_size: 4096, num_layers: 32")
    )
    assert runner.invoke(app, ["compile", "big.yaml"]).exit_code == 0
    big = json.loads(runner.invoke(app, ["show", "big.plan.yaml", "--json", "--calibration", str(cal)]).stdout)
    assert big["price"]["kind"] == "predicted" and big["price"]["graph_memory_reserve_bytes"] is None
    assert any("calibration h200-vllm033-tiny-llama not used" in n for n in big["price"]["notes"])
    text = runner.invoke(app, ["show", "big.plan.yaml", "--calibration", str(cal)]).stdout
    assert "vLLM's own estimate stays in charge of the KV cache" in text


def _first_capture(cal: Path, out: Path) -> Path:
    """`cal` as if its starts had captured first (a start with the KV cache's size given)."""
    data = yaml.safe_load(cal.read_text())
    for start in data["starts"]:
        start["after_profiling"] = False
    out.write_text(yaml.safe_dump(data))
    return out


def test_flags_says_the_graph_memory_to_leave_free_on_stderr_only_where_measured(tmp_path, monkeypatch):
    """`flags` prints the launch arguments on stdout, unchanged, and the graph memory to leave free
    beside the KV cache on stderr: measured from the folder's starts of this plan; for another
    plan of the deployment, that vLLM's estimate stays in charge; nothing without a calibration,
    or where a found one is of another model; a --calibration given that does not apply says so."""
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(_tiny_named())
    Path("other.yaml").write_text(_tiny_named().replace("max_loras: 3", "max_loras: 4"))
    Path("big.yaml").write_text(
        _tiny_named().replace("hidden_size: 256, num_layers: 2", "hidden_size: 4096, num_layers: 32")
    )
    for name in ("tiny", "other", "big"):
        assert runner.invoke(app, ["compile", f"{name}.yaml"]).exit_code == 0
    plain = runner.invoke(app, ["flags", "tiny.plan.yaml"])
    assert plain.exit_code == 0 and plain.stderr == ""
    shipped = DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml"
    after = runner.invoke(app, ["flags", "tiny.plan.yaml", "--calibration", str(shipped)])
    assert "graph memory no reserve" in after.stderr and "--kv-cache-memory" in after.stderr
    cal = _first_capture(shipped, tmp_path / "first.yaml")
    Path(".capplan/calibration").mkdir(parents=True)
    Path(".capplan/calibration/tiny.yaml").write_text(cal.read_text())
    found = runner.invoke(app, ["flags", "tiny.plan.yaml"])
    assert found.exit_code == 0 and found.stdout == plain.stdout
    measured = json.loads(runner.invoke(app, ["show", "tiny.plan.yaml", "--json"]).stdout)["price"]
    assert f"({measured['graph_memory_reserve_bytes']} bytes" in found.stderr and "# (measured;" in found.stderr
    scaled = runner.invoke(app, ["flags", "other.plan.yaml"])
    assert "vLLM's own estimate stays in charge" in scaled.stderr and "# (scaled;" in scaled.stderr
    assert runner.invoke(app, ["flags", "big.plan.yaml"]).stderr == ""  # the folder's is of another model
    given = runner.invoke(app, ["flags", "big.plan.yaml", "--calibration", str(cal)])
    assert "vLLM's own estimate stays in charge" in given.stderr and "not used" in given.stderr
    runs_only = runner.invoke(app, ["flags", "tiny.plan.yaml", "--calibration", str(DATA / "h200-vllm025.yaml")])
    assert runs_only.exit_code == 0 and "vLLM's own estimate stays in charge" in runs_only.stderr
    assert "not used: uncalibrated: measured on llama0.9b" in runs_only.stderr  # another model's runs: said
    missing = runner.invoke(app, ["flags", "tiny.plan.yaml", "--calibration", "nope.yaml"])
    assert missing.exit_code in (1, 2) and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "nope.yaml" in missing.stderr and "Traceback" not in missing.stderr


def test_a_model_config_gives_the_shape_model_the_intermediate_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a.yaml").write_text(
        _tiny_named().replace("hidden_size: 256, num_layers: 2", "hidden_size: 4096, num_layers: 32")
    )
    Path("b.yaml").write_text(Path("a.yaml").read_text().replace("max_loras: 3", "max_loras: 4"))
    Path("config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "torch_dtype": "bfloat16"}
        )
    )
    plain = json.loads(runner.invoke(app, ["diff", "--spec", "a.yaml", "b.yaml", "--format", "json"]).stdout)
    given = runner.invoke(
        app, ["diff", "--spec", "a.yaml", "b.yaml", "--format", "json", "--model-config", "config.json"]
    )
    priced = json.loads(given.stdout)["price"]["old"]
    assert any("intermediate size not given" in n for n in plain["price"]["old"]["notes"])
    assert not any("intermediate size not given" in n for n in priced["notes"])
    assert priced["graph_memory_gib"]["value"] > plain["price"]["old"]["graph_memory_gib"]["value"]


def test_the_runtime_records_the_deployment_and_calibrate_start_takes_it_as_measured(plans, tmp_path, monkeypatch):
    """A report of this runtime carries the identity read from vLLM's config: calibrate-start
    records it as measured (nothing given), refuses a given value that contradicts it, and a
    start whose release is not the plan's."""
    from types import SimpleNamespace

    from capplan.runtime.report import deployment_identity

    hf = SimpleNamespace(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=2048, num_local_experts=None)  # fmt: skip
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype="torch.bfloat16", model="/models/tiny"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1),
        lora_config=SimpleNamespace(max_lora_rank=8),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name="TRITON_ATTN")),
    )
    ident = deployment_identity(config)
    assert ident["shape"] == {"num_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 2048, "dtype": "bfloat16"}  # fmt: skip
    assert ident["model"] == "/models/tiny" and ident["lora_rank"] == 8 and ident["attention_backend"] == "TRITON_ATTN"
    partial = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2), dtype="x"))
    assert "shape" not in deployment_identity(partial)  # no hidden size: no shape, the report stays readable
    ident |= {"gpu": "NVIDIA H200", "vllm": "0.33.0"}
    report = json.loads((ROOT / TINY_REPORTS[0]).read_text()) | {"identity": ident}
    path = tmp_path / "start.report.json"
    path.write_text(json.dumps(report, indent=2))
    out = tmp_path / "cal.yaml"
    made = _calibrate([str(path), "--plan", str(plans["tiny"])], out)
    assert made.exit_code == 0, made.output
    cal = yaml.safe_load(out.read_text())
    assert cal["identity"]["given"] == [] and cal["identity"]["gpu"] == "NVIDIA H200"
    assert cal["identity"]["shape"]["num_layers"] == 2 and cal["identity"]["model"]["name"] == "/models/tiny"
    out.unlink()
    _refused([str(path), "--plan", str(plans["tiny"]), "--gpu", "NVIDIA H100"], out, "but the starts recorded")
    path.write_text(json.dumps(report | {"identity": ident | {"vllm": "0.29.0"}}))
    _refused([str(path), "--plan", str(plans["tiny"])], out, "the starts ran vLLM 0.29.0: a start of another release")


def test_a_calibration_folder_of_two_deployments_prices_nothing_and_one_is_found_from_below(tmp_path, monkeypatch):
    """The folder is found from a plan's folder or any folder below it, the way git finds its
    config; a folder holding calibrations of two deployments prices nothing, said in one note
    naming both (the diff itself still runs: a found folder never breaks the review)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".capplan/calibration").mkdir(parents=True)
    for name in ("h200-vllm033-tiny-llama", "h200-vllm033-llama0.9b"):
        (tmp_path / ".capplan/calibration" / f"{name}.yaml").write_text(
            (DATA / "calibrations" / f"{name}.yaml").read_text()
        )
    deep = tmp_path / "deploy" / "plans"
    deep.mkdir(parents=True)
    (deep / "a.yaml").write_text(_tiny_named())
    (deep / "b.yaml").write_text(_tiny_named().replace("max_loras: 3", "max_loras: 4"))
    result = runner.invoke(app, ["diff", "--spec", str(deep / "a.yaml"), str(deep / "b.yaml")])
    assert result.exit_code == 2 and result.stderr == ""
    said = [line for line in result.stdout.splitlines() if "are of different deployments" in line]
    assert len(said) == 1 and said[0].startswith("  calibration folder not read, so it prices nothing: ")
    (tmp_path / ".capplan/calibration/h200-vllm033-llama0.9b.yaml").unlink()
    data = json.loads(
        runner.invoke(app, ["diff", "--spec", str(deep / "a.yaml"), str(deep / "b.yaml"), "--format", "json"]).stdout
    )
    assert data["price"]["old"]["kind"] == "measured" and ".capplan/calibration" in data["price"]["old"]["basis"]


_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    figures=st.fixed_dictionaries(
        {"capture_seconds": st.one_of(st.floats(-1, 1e7), st.integers(-1, 10**7)),
         "graph_memory_gib": st.one_of(st.floats(-1, 1e6), st.none(), st.integers(0, 10**6)),
         "graphs_captured": st.sampled_from([66, 65, 0]), "deferred": st.sampled_from([None, {}])},
    ),
    identity=st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {},
            optional={"gpu": _TEXT, "vllm": st.sampled_from(["0.33.0", "0.32.0+cu130", "0.29.0", ""]), "torch": _TEXT,
                      "model": _TEXT, "lora_rank": st.integers(-2, 1 << 17), "tensor_parallel_size": st.integers(0, 4),
                      "shape": st.fixed_dictionaries({"num_layers": st.integers(0, 4), "hidden_size": st.integers(1, 8)},
                                                     optional={"dtype": _TEXT})},
        ),
    ),
    gpu=st.one_of(st.none(), _TEXT),
)  # fmt: skip
def test_calibrate_start_on_any_report_of_the_plan_writes_a_calibration_or_one_line(
    plans, tmp_path_factory, figures, identity, gpu
):
    """A report with the plan's fingerprint and any figures and identity: a calibration that
    loads, or exit 1/2 with one line and nothing written."""
    from capplan.loading import load_calibration

    work = tmp_path_factory.mktemp("r")
    report = json.loads((ROOT / TINY_REPORTS[0]).read_text()) | figures | {"identity": identity}
    report["graphs_planned"] = 66
    (work / "r.json").write_text(json.dumps(report))
    out = work / "cal.yaml"
    args = [str(work / "r.json"), "--plan", str(plans["tiny"])] + ([] if gpu is None else ["--gpu", gpu])
    result = _calibrate(args, out)
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        load_calibration(out)
    else:
        assert result.exit_code in (1, 2) and not out.exists(), result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_git_s_diff_driver_prices_by_the_calibration_folder_of_the_work_tree(tmp_path, monkeypatch):
    from capplan.commands.diff import git_diff

    monkeypatch.chdir(tmp_path)
    Path("deploy").mkdir()
    Path("deploy/old.yaml").write_text(_tiny_named())
    Path("deploy/new.yaml").write_text(_tiny_named().replace("max_loras: 3", "max_loras: 4"))
    for name in ("old", "new"):
        assert runner.invoke(app, ["compile", f"deploy/{name}.yaml"]).exit_code == 0
    args = [
        "deploy/tiny.plan.yaml",
        "deploy/old.plan.yaml",
        "0" * 40,
        "100644",
        "deploy/new.plan.yaml",
        "1" * 40,
        "100644",
    ]
    assert "(measured / scaled)" not in git_diff(args).text.splitlines()[0]
    Path(".capplan/calibration").mkdir(parents=True)
    Path(".capplan/calibration/tiny.yaml").write_text(
        (DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml").read_text()
    )
    assert git_diff(args).text.splitlines()[0].endswith("GiB graph memory (measured / scaled)")
    Path(".capplan/calibration/tiny.yaml").write_text("not: [a calibration")
    assert "graphs" in git_diff(args).text.splitlines()[0]  # a broken folder prices nothing; git diff still works


@settings(max_examples=200, deadline=None)
@given(named=st.text(max_size=30), measured=st.text(max_size=40))
def test_a_gpu_name_names_the_measured_gpu_it_begins(named, measured):
    from capplan.calibration.identity import same_gpu

    assert same_gpu("NVIDIA H100", "NVIDIA H100 80GB HBM3") and same_gpu("h200", "NVIDIA H200")
    assert not same_gpu("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3") and not same_gpu("NVIDIA", "NVIDIA H200")
    assert same_gpu(named, measured) in (True, False)  # any text: an answer, never an error
    if named.strip() and named.lower().replace("nvidia", "").split():
        assert same_gpu(named, f"{named} 80GB HBM3") and not same_gpu(f"{named} PCIe", named)


def test_optimize_budgets_graph_memory_and_seconds_by_the_deployment_s_starts(tmp_path):
    """A calibration of the deployment's own starts prices optimize's budgets: the plan those
    starts ran at their median, every other candidate scaled from them (was refused: "no
    capture runs"); a budget the default plan breaks is met by fewer graphs."""
    import statistics

    from capplan.calibration.price import load_pricer
    from capplan.loading import load_spec, load_steps
    from capplan.planner import Batch
    from capplan.planner.compiler import compile_plan
    from capplan.traffic.optimize import optimize
    from capplan.traffic.simulate import TraceBatch

    _, tiny = _gpu_specs()
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(
        tiny.replace(
            'target: {runner: mrv2, vllm: "0.33.0"}',
            'target: {runner: mrv2, vllm: "0.33.0", gpu: NVIDIA H200}\n'
            "model: {name: tiny-llama, hidden_size: 256, num_layers: 2, dtype: bfloat16}\n"
            "parallel: {tensor_parallel_size: 1, pipeline_parallel_size: 1}",
        )
    )
    spec = load_spec(spec_path)
    cal = DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml"
    steps, pricer = load_steps(cal), load_pricer(cal)
    est = pricer.price(compile_plan(spec))
    reports = [json.loads((ROOT / r).read_text()) for r in TINY_REPORTS]
    assert est.kind == "measured" and est.gib.value == statistics.median(r["graph_memory_gib"] for r in reports)
    assert est.seconds.value == statistics.median(r["capture_seconds"] for r in reports)
    trace = [TraceBatch(Batch(n, n, 1), 10) for n in (1, 3, 7, 12, 30)]
    for budget in (
        {"max_graph_memory": est.gib.value * 0.6},
        {"max_capture_seconds": est.seconds.value * 0.6},
    ):
        result = optimize(spec, trace, steps, pricer=pricer, objective="padding", **budget)
        assert result.default.graphs == est.graphs and result.point.graphs < est.graphs
        got = result.point.graph_memory_gib if "max_graph_memory" in budget else result.point.capture_seconds
        assert got is not None and got <= next(iter(budget.values()))
    # the command: the same calibration given to `capplan optimize`
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text("".join(f'{{"num_reqs": {n}, "num_tokens": {n}, "max_query_len": 1}}\n' for n in (1, 7, 30)))
    calibration = str(DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml")
    limit = f"{est.gib.value * 0.9:.6f}"
    args = ["optimize", str(spec_path), str(trace_file), "--calibration", calibration, "--max-graph-memory", limit]
    done = runner.invoke(app, [*args, "--objective", "padding", "--json"])
    assert done.exit_code == 0, done.output
    chosen = json.loads(done.stdout)["chosen"]
    assert chosen["graphs"] < est.graphs and chosen["graph_memory_gib"] <= float(limit), chosen


def test_a_price_says_whose_starts_it_rests_on_and_another_release_is_said(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = DATA / "calibrations" / "h200-vllm033-tiny-llama.yaml"
    Path("tiny.yaml").write_text(_tiny_named())
    assert runner.invoke(app, ["compile", "tiny.yaml"]).exit_code == 0
    price = json.loads(runner.invoke(app, ["show", "tiny.plan.yaml", "--json", "--calibration", str(shipped)]).stdout)
    assert price["price"]["kind"] == "measured"
    assert "on model tiny-llama, GPU NVIDIA H200, vLLM 0.33.0" in price["price"]["basis"]
    assert not any("another release" in n for n in price["price"]["notes"])
    # The same deployment planned for 0.29.0: priced from 0.33.0 starts, and said so
    Path("old.yaml").write_text(_tiny_named().replace('vllm: "0.33.0"', 'vllm: "0.29.0"'))
    assert runner.invoke(app, ["compile", "old.yaml"]).exit_code == 0
    old = json.loads(runner.invoke(app, ["show", "old.plan.yaml", "--json", "--calibration", str(shipped)]).stdout)
    assert old["price"]["kind"] == "scaled" and "vLLM 0.33.0" in old["price"]["basis"]
    assert (
        "the starts ran vLLM 0.33.0; this plan targets vLLM 0.29.0: another release's figures"
        in (old["price"]["notes"])
    )


def test_a_planted_calibration_folder_above_the_plans_cannot_advise_an_impossible_reserve(tmp_path, monkeypatch):
    """A `.capplan/calibration` folder in a parent folder, with a start of the plan's own
    fingerprint claiming 99,999 GiB of graphs: not read, said in one note naming the file and
    the field, never printed as memory to leave free; the commands still run."""
    work = tmp_path / "deploy" / "plans"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    Path("tiny.yaml").write_text(_tiny_named())
    assert runner.invoke(app, ["compile", "tiny.yaml"]).exit_code == 0
    fingerprint = yaml.safe_load(Path("tiny.plan.yaml").read_text())["fingerprint"]
    planted = tmp_path / ".capplan" / "calibration"
    planted.mkdir(parents=True)
    start = {"report": "r.json", "fingerprint": fingerprint, "graphs": 66, "lora_graphs": 48, "max_tokens": 64,
             "capture_seconds": 1.0, "graph_memory_gib": 99999.0, "after_profiling": False}  # fmt: skip
    (planted / "x.yaml").write_text(yaml.safe_dump({"name": "x", "starts": [start]}))
    for args, where in ((["flags", "tiny.plan.yaml"], "stderr"), (["show", "tiny.plan.yaml"], "stdout")):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
        said = [line for line in getattr(result, where).splitlines() if "x.yaml" in line]
        assert len(said) == 1 and "starts.0.graph_memory_gib: must be <= 1024" in said[0], said
        assert "109998" not in result.output and "to leave free beside the KV cache:" not in result.output
