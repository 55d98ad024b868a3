"""The two deployments a platform engineer brought, from their files alone, judged by vLLM's
own parser (0.31.0 and 0.33.0, on CPU): a Qwen2.5-7B `vllm.yaml` (read through a spec's
`deployment` section) and a Llama-3.1-70B TP 4 serve line with no `--max-model-len` (through
`init`). What `capplan apply` adds to the operator's line is only what vLLM would take on its
own: each added value equals vLLM's parse of the line as given, or is one vLLM leaves to its
config resolution (the cudagraph mode and sizes, which the planner's conformance tier proves
equal to vLLM's); nothing vLLM derives from the model or the GPU is ever added."""

from __future__ import annotations

from unittest.mock import patch

import pytest

from capplan.commands.init import InitRequest, init
from capplan.launcher.cmdline import COMPILATION, RESOLVED, read_resolved
from capplan.launcher.engine_args import complete, contradictions
from capplan.launcher.vllm_cli import resolution_of
from capplan.loading import load_deployed_spec
from capplan.planner.compiler import compile_plan
from capplan.settings import SETTINGS
from tests.conformance.test_deployment_vllm import REAL, oracle_reader
from tests.conformance.test_init_roundtrip import PYTHON, _env, _oracle

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]
QWEN = """\
model: Qwen/Qwen2.5-7B-Instruct
enable-lora: true
max-loras: 4
max-lora-rank: 32
max-num-seqs: 128
max-num-batched-tokens: 8192
max-model-len: 32768
gpu-memory-utilization: 0.9
enable-prefix-caching: true
port: 8000
"""
LLAMA_70B = ["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--tensor-parallel-size", "4", "--enable-lora",
             "--max-loras", "8", "--max-lora-rank", "16", "--port", "8000"]  # fmt: skip
DERIVED = {s.name for s in SETTINGS if s.derived_from}


def _added_only_what_vllm_takes(plan, argv, version):
    resolved = resolution_of(REAL(str(PYTHON), [argv], _env(version))[0])
    cmd = read_resolved(argv, resolved)
    assert contradictions(plan, cmd) == []
    full, added = complete(plan, cmd)
    again = read_resolved(full, resolution_of(REAL(str(PYTHON), [full], _env(version))[0]))
    moved = {name for name, value in again.values.items() if cmd.values.get(name) != value}
    assert not moved & DERIVED, moved  # never max_model_len, max_num_seqs, max_num_batched_tokens
    by_dest = {s.name: dest for dest, s in RESOLVED.items()}
    by_key = {s.name: key for key, s in COMPILATION.items()}
    for name in sorted(moved):
        if name in by_key:  # a compilation-config key vLLM resolves from the others later (None at parse time)
            assert resolved.compilation.get(by_key[name]) in (None, again.values[name]), (name, added)
        else:  # an engine argument: vLLM's parse of the line as given has the same value
            assert resolved.values.get(by_dest[name]) == again.values[name], (name, added)
    return added


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_the_qwen_vllm_yaml_through_a_deployment_spec(version, tmp_path):
    _oracle(version)
    (tmp_path / "vllm.yaml").write_text(QWEN)
    spec_path = tmp_path / "deploy.yaml"
    spec_path.write_text(f'deployment: {{config: vllm.yaml}}\ntarget: {{vllm: "{version}"}}\n')

    with patch("capplan.launcher.cmdline.read_with_vllm", oracle_reader(version)):
        spec, found = load_deployed_spec(spec_path)
    assert found is not None and (spec.lora.max_lora_rank, spec.scheduler.max_model_len) == (32, 32768)
    added = _added_only_what_vllm_takes(compile_plan(spec), found.argv, version)
    assert "--max-lora-rank" not in added and "--port" not in added


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_the_70b_line_with_no_max_model_len(version):
    _oracle(version)
    made = init(InitRequest(None, LLAMA_70B, vllm=version, python=str(PYTHON), env=_env(version)))
    spec = made.spec
    assert spec.parallel.tensor_parallel_size == 4 and spec.lora.max_lora_rank == 16
    # the spec's defaults for what vLLM derives are said as such in its header
    said = " ".join(made.defaults)
    for flag in ("scheduler.max_model_len", "scheduler.max_num_seqs", "scheduler.max_num_batched_tokens"):
        assert flag in said
    assert "vLLM derives it from the model" in said and "vLLM derives it from the GPU it starts on" in said
    added = _added_only_what_vllm_takes(compile_plan(spec), LLAMA_70B, version)
    assert not {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"} & set(added)
