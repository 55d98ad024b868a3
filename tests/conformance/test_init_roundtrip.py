"""From a deployment's vllm.yaml to a plan and back, judged by vLLM's own parser (0.25.0, 0.29.0
and 0.33.0, on CPU): `capplan init` reads the file with vLLM's parser, `compile` plans it for
each release, `flags --format yaml` writes the plan's settings as config-file keys, and vLLM's
parser of that release, reading `vllm serve M --config THAT_FILE`, resolves exactly the plan's
values. capplan's own reader makes the same spec of the file (no third answer)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest.mock import patch

import pytest

from capplan.commands.init import InitRequest, init
from capplan.launcher.cmdline import RESOLVED, read_resolved, read_with_vllm
from capplan.launcher.engine_args import contradictions, render
from capplan.launcher.vllm_cli import resolution_of
from capplan.planner.compiler import compile_plan
from capplan.settings import BY_NAME, line_values
from tests.test_init import EXAMPLE  # the deployment's vllm.yaml, as the unit tests read it

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
PYTHON = ORACLE_DIR / "venv" / "bin" / "python"
VERSIONS = ("0.25.0", "0.29.0", "0.33.0")

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]


def _env(version: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ORACLE_DIR / "src" / version)}


def _oracle(version: str) -> None:
    if not PYTHON.exists() or not (ORACLE_DIR / "src" / version / "vllm").is_dir():
        if os.environ.get("CAPPLAN_REQUIRE_ORACLE") == "1":
            pytest.fail(f"vLLM oracle required but {ORACLE_DIR}/src/{version} is missing")
        pytest.skip(f"vLLM oracle not available ({ORACLE_DIR}/src/{version}); run .ci/run")


@pytest.mark.parametrize("version", VERSIONS)
def test_init_compile_flags_yaml_reads_back_as_the_plan_in_vllm(version, tmp_path):
    _oracle(version)
    config = tmp_path / "vllm.yaml"
    config.write_text(EXAMPLE)
    made = init(InitRequest(config, [], vllm=version, python=str(PYTHON), env=_env(version)))
    assert made.reader == "read by vLLM's own argument parser", made.reader
    with patch("capplan.launcher.cmdline.read_with_vllm", return_value=None):
        own = init(InitRequest(config, [], vllm=version))
    assert own.spec == made.spec  # both readers make one spec of the file, and say the same of it
    fields = [sorted(c.rsplit(" -> ", 1)[1] for c in d.carried) for d in (own, made)]  # each reader words its own
    assert (sorted(own.not_carried), fields[0], own.defaults) == (sorted(made.not_carried), fields[1], made.defaults)
    spec = made.spec
    assert spec.model is not None and spec.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens, spec.scheduler.max_model_len) == (
        64,
        8192,
        8192,
    )
    assert (spec.lora.enabled, spec.lora.max_loras) == (True, 4)
    named = " ".join(made.not_carried)
    for key in ("--port", "--gpu-memory-utilization"):
        assert key in named, made.not_carried
    assert spec.lora.max_lora_rank == 16 and "--max-lora-rank" not in named  # carried: calibrations compare it

    plan = compile_plan(spec)
    flags = tmp_path / "flags.yaml"
    flags.write_text(render(plan, "yaml", "deploy.plan.yaml") + "\n")
    argv = ["vllm", "serve", "M", "--config", str(flags)]
    results = read_with_vllm(str(PYTHON), [argv], _env(version))  # one run of vLLM's Python
    assert results is not None, "vLLM's parser did not run in the oracle"
    resolved = resolution_of(results[0])
    want = line_values(plan)
    checked = 0
    for name, value in want.items():  # vLLM's resolved value of each, given in the file or vLLM's default
        setting = BY_NAME[name]
        if setting.speculative is not None:
            continue
        flag_value = resolved.values.get(setting.dest) if setting.dest in RESOLVED else None
        have = resolved.compilation[setting.compilation] if flag_value is None and setting.compilation else flag_value
        have = setting.canon(have) if setting.canon is not None and isinstance(have, list) else have
        assert have == value, (name, have, value)
        checked += 1
    assert resolved.speculative is None and want["speculative.num_speculative_tokens"] == 0
    assert checked >= 9
    assert contradictions(plan, read_resolved(argv, resolved)) == []
    print(f"vLLM {version}: {checked} plan settings read back from flags --format yaml")
