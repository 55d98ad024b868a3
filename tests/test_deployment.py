"""A spec's `deployment` section: the deployment's own vLLM config (its vllm.yaml, serve line or
launch script) is the source of every setting it gives. `compile` reads them as vLLM does (here
capplan's own reader: vLLM is not importable; tests/conformance/test_deployment_vllm.py asks
vLLM's parser), refuses a spec that repeats one, and `--check`, the pre-commit hook and the CI
job fail when the config moved and the plan did not, naming the setting."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from unittest.mock import patch

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.cli import app
from capplan.commands.compile import deployment_index
from capplan.errors import SpecError
from capplan.launcher.deployment import serve_line_of
from capplan.loading import load_deployed_spec, load_spec
from capplan.planfile import load_plan
from capplan.planner import compile_plan

runner = CliRunner()
VLLM_YAML = """\
model: Qwen/Qwen2.5-7B-Instruct
enable-lora: true
max-loras: 4
max-lora-rank: 16
max-num-seqs: 128
max-num-batched-tokens: 8192
max-model-len: 32768
gpu-memory-utilization: 0.9
port: 8000
"""
SPEC = 'deployment: {config: vllm.yaml}\ntarget: {vllm: "0.31.0"}\n'
HOOKS = Path(__file__).resolve().parents[1] / ".pre-commit-hooks.yaml"


@pytest.fixture(autouse=True)
def no_vllm():
    """capplan's own reader, as where vLLM is not importable (no subprocess per example)."""
    with patch("capplan.launcher.cmdline.read_with_vllm", return_value=None):
        yield


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("deploy").mkdir()
    Path("deploy/vllm.yaml").write_text(VLLM_YAML)
    Path("deploy/spec.yaml").write_text(SPEC)
    return tmp_path


def run(*args):
    return runner.invoke(app, list(args))


def test_the_plan_holds_the_configs_values_and_the_fingerprint_of_the_same_standalone_spec(repo):
    spec, found = load_deployed_spec(Path("deploy/spec.yaml"))
    assert found is not None and found.label == "deploy/vllm.yaml"
    assert (spec.lora.enabled, spec.lora.max_loras) == (True, 4)
    assert (spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens, spec.scheduler.max_model_len) == (
        128,
        8192,
        32768,
    )
    assert spec.model is not None and spec.model.name == "Qwen/Qwen2.5-7B-Instruct"
    standalone = yaml.safe_load(SPEC) | {
        "lora": {"enabled": True, "max_loras": 4},
        "scheduler": {"max_num_seqs": 128, "max_num_batched_tokens": 8192, "max_model_len": 32768},
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    }
    del standalone["deployment"]
    Path("standalone.yaml").write_text(yaml.safe_dump(standalone))
    # where the settings came from changes no graph: the same fingerprint, so calibrations still match
    assert compile_plan(spec).fingerprint == compile_plan(load_spec(Path("standalone.yaml"))).fingerprint
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 0, result.output
    plan = load_plan(Path("deploy/spec.plan.yaml"))
    assert plan.spec.deployment is not None and plan.spec.deployment.config == "vllm.yaml"
    assert stat.S_IMODE(os.stat("deploy/spec.plan.yaml").st_mode) == 0o644
    assert run("compile", "--check", "deploy/spec.yaml").exit_code == 0


def test_a_vllm_yaml_edit_without_a_recompiled_plan_fails_check_the_hook_and_the_ci_job(repo):
    assert run("compile", "deploy/spec.yaml").exit_code == 0
    Path("deploy/vllm.yaml").write_text(VLLM_YAML.replace("max-loras: 4", "max-loras: 10"))
    check = run("compile", "--check", "deploy/spec.yaml")
    assert check.exit_code == 1
    assert check.stderr.strip() == (
        "error: plan is stale (deploy/spec.plan.yaml: deploy/vllm.yaml now sets lora.max_loras 10 "
        "(--max-loras 10), the plan has 4): run capplan compile deploy/spec.yaml"
    )
    # The pre-commit hook passes only the changed file: the vLLM config, checked through its spec.
    hook = yaml.safe_load(HOOKS.read_text())[0]
    assert hook["args"] == ["--check", "--skip-non-specs"]
    import re

    assert re.search(hook["files"], "deploy/vllm.yaml") and re.search(hook["files"], "deploy/serve.sh")
    hooked = run("compile", *hook["args"], "deploy/vllm.yaml")
    assert hooked.exit_code == 1
    assert "deploy/vllm.yaml: checked through deploy/spec.yaml (whose deployment reads it)" in hooked.stderr
    assert "now sets lora.max_loras 10" in hooked.stderr
    # The CI job passes every spec: the same answer.
    assert run("compile", "--check", "--skip-non-specs", "deploy/spec.yaml", "deploy/vllm.yaml").exit_code == 1
    assert run("compile", "deploy/spec.yaml").exit_code == 0
    assert run("compile", *hook["args"], "deploy/vllm.yaml").exit_code == 0
    # a setting of no plan (the port) moves nothing
    Path("deploy/vllm.yaml").write_text(VLLM_YAML.replace("max-loras: 4", "max-loras: 10").replace("8000", "9000"))
    assert run("compile", "--check", "deploy/spec.yaml").exit_code == 0


def test_a_config_no_spec_reads_is_still_skipped(repo):
    Path("other.yaml").write_text("apiVersion: v1\nkind: ConfigMap\n")
    result = run("compile", "--check", "--skip-non-specs", "other.yaml")
    assert result.exit_code == 0 and "other.yaml: skipped, not a capplan spec" in result.stderr
    index = deployment_index()
    assert index[os.path.realpath("deploy/vllm.yaml")] == [Path("deploy/spec.yaml")]
    assert os.path.realpath("other.yaml") not in index


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            SPEC + "lora: {max_loras: 3}\n",
            "error: deploy/spec.yaml: lora.max_loras is set here and by deploy/vllm.yaml: --max-loras 4 (in --config "
            "deploy/vllm.yaml) (remove lora.max_loras from the spec: compile reads it from the deployment)",
        ),
        (
            SPEC + "model: {name: other}\n",
            "error: deploy/spec.yaml: model.name is set here and by deploy/vllm.yaml: model.name (remove model.name "
            "from the spec: compile reads it from the deployment)",
        ),
        (
            "deployment: {config: nope.yaml}\n",
            "error: deploy/spec.yaml: deployment.config: deploy/nope.yaml: no such file",
        ),
        ("deployment: {config: ..}\n", "error: deploy/spec.yaml: deployment.config: deploy/..: is a directory"),
        (
            "deployment: {}\n",
            "error: deploy/spec.yaml: deployment: name the deployment's vLLM config: config (a vllm.yaml), command or "
            "script",
        ),
        ("deployment: 3\n", "error: deploy/spec.yaml: deployment: must be a mapping of keys to values (got 3)"),
        ("deployment: {config: vllm.yaml, cfg: x}\n", "error: deploy/spec.yaml: deployment.cfg: unknown key"),
        (
            "deployment: {command: 'vllm serve M --max-loras \"4'}\n",
            "error: deploy/spec.yaml: deployment.command: does not split as a shell line (No closing quotation)",
        ),
        (
            "deployment: {command: 'ls -l'}\n",
            "error: deploy/spec.yaml: deployment.command: ls -l: not a `vllm serve` or `python -m "
            "vllm.entrypoints.openai.api_server` command (give the line that starts vLLM)",
        ),
        (
            "deployment: {config: vllm.yaml, command: 'vllm serve M --config x.yaml'}\n",
            "error: deploy/spec.yaml: deployment.command: the line reads --config x.yaml, which the spec does not "
            "name (name it in the spec as deployment.config: x.yaml (a path from the spec's folder)",
        ),
    ],
)
def test_bad_deployment_sections_are_one_line_naming_the_field_and_write_nothing(repo, spec, message):
    Path("deploy/spec.yaml").write_text(spec)
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not Path("deploy/spec.plan.yaml").exists()


@pytest.mark.parametrize(
    ("removed", "field", "source"),
    [
        ("max-model-len: 32768\n", "scheduler.max_model_len", "the model"),
        ("max-num-seqs: 128\n", "scheduler.max_num_seqs", "the GPU it starts on"),
        ("max-num-batched-tokens: 8192\n", "scheduler.max_num_batched_tokens", "the GPU it starts on"),
    ],
)
def test_a_value_vllm_derives_is_never_the_specs_default(repo, removed, field, source):
    """vLLM derives max_model_len from the model and the batch limits from the GPU where the config
    leaves them out: the plan takes them from the spec, given on purpose, or refuses."""
    Path("deploy/vllm.yaml").write_text(VLLM_YAML.replace(removed, ""))
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1
    assert result.stderr.strip().startswith(
        f"error: deploy/spec.yaml: {field}: deploy/vllm.yaml leaves it to vLLM, which derives it from {source}"
    )
    section, _, key = field.partition(".")
    Path("deploy/spec.yaml").write_text(SPEC + f"{section}: {{{key}: 8192}}\n")
    assert run("compile", "deploy/spec.yaml").exit_code == 0


def test_a_config_value_the_plan_cannot_hold_is_refused_at_compile(repo):
    Path("deploy/vllm.yaml").write_text(VLLM_YAML + "enforce-eager: true\n")
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1
    assert result.stderr.strip().startswith(
        "error: deploy/spec.yaml: deploy/vllm.yaml: --enforce-eager runs no CUDA graph, the plan cudagraph.mode "
        "FULL_AND_PIECEWISE (change the vLLM config: capplan apply would refuse to start it with this plan)"
    )


def test_the_serve_line_from_a_command_or_a_script(repo):
    line = "vllm serve Qwen/Qwen2.5-7B-Instruct --enable-lora --max-loras 2 --max-num-seqs 64 --max-model-len 4096"
    Path("deploy/spec.yaml").write_text(f"deployment:\n  command: {line} --max-num-batched-tokens 2048\n")
    spec = load_spec(Path("deploy/spec.yaml"))
    assert (spec.lora.max_loras, spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens) == (2, 64, 2048)
    Path("deploy/serve.sh").write_text(
        "#!/bin/sh\nset -e\n# start the server\nexport HF_HOME=/models\n"
        "HF_HUB_OFFLINE=1 exec vllm serve Qwen/Qwen2.5-7B-Instruct \\\n  --enable-lora --max-loras 2 \\\n"
        "  --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096  # the one server\n"
    )
    Path("deploy/spec.yaml").write_text("deployment: {config: vllm.yaml, script: serve.sh}\n")
    spec, found = load_deployed_spec(Path("deploy/spec.yaml"))
    # the line's flags after the file's, as vLLM reads them: the line wins
    assert (spec.lora.max_loras, spec.scheduler.max_num_seqs, spec.scheduler.max_model_len) == (2, 64, 4096)
    assert found is not None and found.script == Path("deploy/serve.sh")
    assert run("compile", "deploy/spec.yaml").exit_code == 0
    Path("deploy/serve.sh").write_text(Path("deploy/serve.sh").read_text().replace("--max-loras 2", "--max-loras 3"))
    hooked = run("compile", "--check", "--skip-non-specs", "deploy/serve.sh")
    assert (
        hooked.exit_code == 1
        and "deploy/vllm.yaml and deploy/serve.sh now set lora.max_loras 3 (--max-loras 3)" in hooked.stderr
    )
    # the plan is never written over its own deployment's files
    refused = run("compile", "deploy/spec.yaml", "-o", "deploy/serve.sh")
    assert refused.exit_code == 1 and "is the deployment's launch script deploy/spec.yaml reads" in refused.stderr
    assert "--max-loras 3" in Path("deploy/serve.sh").read_text()


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("#!/bin/sh\necho hi\n", "no line starts vLLM"),
        ("vllm serve A\nvllm serve B\n", "2 lines start vLLM; capplan reads one"),
        ("vllm serve 'A\n", "a line naming vllm does not split as a shell line"),
    ],
)
def test_a_script_with_no_or_two_serve_lines_is_refused(script, message):
    with pytest.raises(SpecError) as err:
        serve_line_of(script, "serve.sh", SpecError)
    assert err.value.message.startswith(f"serve.sh: {message}")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    section=st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=20),
        st.lists(st.text(max_size=5), max_size=3),
        st.dictionaries(
            st.sampled_from(["config", "command", "script", "other"]),
            st.one_of(
                st.none(), st.integers(), st.booleans(), st.text(max_size=40), st.lists(st.integers(), max_size=2)
            ),
            max_size=3,
        ),
    )
)
def test_any_deployment_section_compiles_or_is_one_error(section, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "vllm.yaml").write_text(VLLM_YAML)
    (folder / "serve.sh").write_text("vllm serve M --max-loras 2\n")
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump({"deployment": section, "target": {"vllm": "0.31.0"}}))
    try:
        load_deployed_spec(path)
    except SpecError as exc:
        assert "\n" not in exc.message and exc.message.startswith(str(path))
    assert sorted(os.listdir(folder)) == ["serve.sh", "spec.yaml", "vllm.yaml"]


def test_flags_of_a_deployment_spec_keeps_the_operators_line_whole(repo):
    Path("deploy/serve.sh").write_text(
        "vllm serve Qwen/Qwen2.5-7B-Instruct --port 8001 --enable-prefix-caching --max-lora-rank 32 "
        "--gpu-memory-utilization 0.85\n"
    )
    Path("deploy/spec.yaml").write_text("deployment: {config: vllm.yaml, script: serve.sh}\n")
    missing = run("flags", "deploy/spec.yaml")  # CAPPLAN_PLAN would name a plan not written yet
    assert missing.exit_code == 1 and "run capplan compile deploy/spec.yaml first" in missing.stderr
    assert run("compile", "deploy/spec.yaml").exit_code == 0
    result = run("flags", "deploy/spec.yaml")
    assert result.exit_code == 0, result.output
    import shlex

    words = shlex.split(result.stdout)
    assert words[0] == "CAPPLAN_PLAN=deploy/spec.plan.yaml" and words[1:3] == ["vllm", "serve"]
    line = " ".join(words)
    for kept in ("--port 8001", "--enable-prefix-caching", "--max-lora-rank 32", "--gpu-memory-utilization 0.85",
                 "--config deploy/vllm.yaml"):  # fmt: skip
        assert kept in line, kept
    # what the plan adds is what vLLM would resolve anyway: nothing the operator set is repeated or changed
    assert "--max-loras" not in line and "--max-num-seqs" not in line and "--compilation-config" in line
    assert run("flags", "deploy/spec.yaml", "--format", "json").stdout.lstrip().startswith("[")
    assert run("flags", "deploy/spec.yaml", "--format", "yaml").exit_code == 2
    assert run("flags", "deploy/spec.yaml", "--format", "python").exit_code == 2
    from_plan = run("flags", "deploy/spec.plan.yaml")
    assert from_plan.exit_code == 0 and "`capplan flags SPEC` prints the deployment's own line" in from_plan.stderr
    Path("alone.yaml").write_text("lora: {enabled: true}\n")
    alone = run("flags", "alone.yaml")
    assert alone.exit_code == 2 and "a spec with no deployment section" in alone.stderr
    Path("deploy/serve.sh").write_text(Path("deploy/serve.sh").read_text().replace("--port 8001", "--max-loras 2"))
    stale = run("flags", "deploy/spec.yaml")
    assert stale.exit_code == 1 and "is not what deploy/spec.yaml compiles to" in stale.stderr


def test_a_compilation_config_in_the_file_that_apply_could_not_complete_is_refused_at_compile(repo):
    Path("deploy/vllm.yaml").write_text(VLLM_YAML + "compilation-config: {cudagraph_mode: PIECEWISE}\n")
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1 and not Path("deploy/spec.plan.yaml").exists()
    assert "deploy/vllm.yaml: the plan needs cudagraph_capture_sizes" in result.stderr
    assert "which the command gives in its --config file" in result.stderr


@pytest.mark.parametrize("rank", ["true", "16.0", "'16'", "17"])
def test_a_rank_that_is_not_one_of_vllms_integers_is_refused(repo, rank):
    Path("deploy/vllm.yaml").write_text(VLLM_YAML.replace("max-lora-rank: 16", "max-lora-rank: 8"))
    Path("deploy/spec.yaml").write_text(f"lora: {{enabled: true, max_lora_rank: {rank}}}\n")
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1 and "lora.max_lora_rank" in result.stderr


def test_hostile_scripts_lines_and_trees(repo):
    """What a shell would do differently, or a tree the hook walks, found by a hostile pass."""
    # a backslash-newline is removed, as the shell removes it: `1\\n6` is 16
    Path("deploy/serve.sh").write_text(
        "vllm serve M --enable-lora --max-loras 2 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--max-model-len 4096 --cudagraph-capture-sizes 1 2 4 8 1\\\n6 32\n"
    )
    Path("deploy/spec.yaml").write_text("deployment: {script: serve.sh}\n")
    assert load_spec(Path("deploy/spec.yaml")).cudagraph.capture_sizes == [1, 2, 4, 8, 16, 32]
    # what the shell expands at launch is not in the file: refused, never read as text
    for line in ('ARGS="M --max-loras 8"\nvllm serve $ARGS --max-num-seqs 8\n', "vllm serve ${MODEL} --max-loras 2\n",
                 "vllm serve M --max-loras `cat n`\n"):  # fmt: skip
        Path("deploy/serve.sh").write_text(line)
        result = run("compile", "deploy/spec.yaml")
        assert result.exit_code == 1 and "the shell expands it when the server starts" in result.stderr, line
    Path("deploy/spec.yaml").write_text("deployment: {command: 'vllm serve $MODEL --max-loras 2'}\n")
    assert "the shell expands it" in run("compile", "deploy/spec.yaml").stderr
    # the api_server module takes no positional argument (vLLM refuses it): never read as the model
    Path("deploy/spec.yaml").write_text(
        "deployment: {command: 'python -m vllm.entrypoints.openai.api_server M --max-num-seqs 8'}\n"
    )
    refused = run("compile", "deploy/spec.yaml")
    assert refused.exit_code == 1 and "takes no positional argument" in refused.stderr
    # the line's own --config is the deployment's config, read from the spec's folder; another is refused
    Path("deploy/serve.sh").write_text("cd /srv && exec vllm serve --config vllm.yaml --port 9\n")
    Path("deploy/spec.yaml").write_text("deployment: {config: vllm.yaml, script: serve.sh}\n")
    spec, found = load_deployed_spec(Path("deploy/spec.yaml"))
    assert found is not None and found.argv.count("--config") == 1 and spec.lora.max_loras == 4
    Path("deploy/spec.yaml").write_text("deployment: {script: serve.sh}\n")
    assert "which the spec does not name" in run("compile", "deploy/spec.yaml").stderr


def test_the_hook_never_waits_on_a_fifo_or_reads_a_device_and_knows_a_config_in_vllms_own_names(repo):
    Path("deploy/spec.yaml").write_text(SPEC)
    assert run("compile", "deploy/spec.yaml").exit_code == 0
    os.mkfifo("deploy/zz.yaml")
    os.symlink("/dev/zero", "deploy/zero.yaml")
    hooked = run("compile", "--check", "--skip-non-specs", "deploy/vllm.yaml")
    assert hooked.exit_code == 0 and "checked through deploy/spec.yaml" in hooked.stderr
    fifo = run("compile", "--check", "--skip-non-specs", "deploy/zz.yaml")
    assert fifo.exit_code == 1 and "Traceback" not in fifo.output
    # vLLM also reads underscored keys: a config such as this is checked through its spec, not taken for one
    Path("deploy/vllm.yaml").write_text(
        "model: Qwen/Qwen2.5-7B-Instruct\nenable_lora: true\nmax_loras: 6\nmax_num_seqs: 128\n"
        "max_num_batched_tokens: 8192\nmax_model_len: 32768\n"
    )
    moved = run("compile", "--check", "--skip-non-specs", "deploy/vllm.yaml")
    assert moved.exit_code == 1 and "now sets lora.max_loras 6" in moved.stderr
    Path("other.yaml").write_text("model: Qwen/Qwen3-8B\n")  # read by no spec, and no spec either
    assert "skipped, not a capplan spec" in run("compile", "--check", "--skip-non-specs", "other.yaml").stderr


def test_a_bad_value_from_the_config_names_where_it_came_from(repo):
    Path("deploy/vllm.yaml").write_text(VLLM_YAML.replace("max-lora-rank: 16", "max-lora-rank: 17"))
    result = run("compile", "deploy/spec.yaml")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "error: deploy/spec.yaml: lora.max_lora_rank (--max-lora-rank 17 (in --config deploy/vllm.yaml), in "
        "deploy/vllm.yaml): "
    ), result.stderr
