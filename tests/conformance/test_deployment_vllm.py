"""A spec's `deployment` section read by vLLM's own parser (0.25.0, 0.29.0 and 0.33.0, on CPU)
and by capplan's own reader: one spec, one plan (no third answer)."""

from __future__ import annotations

from unittest.mock import patch

import pytest

from capplan.errors import SpecError
from capplan.launcher import cmdline
from capplan.launcher.deployment import OWN_READER, VLLM_PARSER
from capplan.loading import load_deployed_spec
from capplan.planner.compiler import compile_plan
from tests.conformance.test_init_roundtrip import PYTHON, VERSIONS, _env, _oracle
from tests.test_init import EXAMPLE

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]
REAL = cmdline.read_with_vllm


def oracle_reader(version: str):
    """`read_with_vllm` as run by the oracle's Python with `version`'s vLLM (whatever Python it is asked for)."""

    def read(python, argvs, env):
        return REAL(str(PYTHON), argvs, _env(version))

    return read


LINE = (
    "HF_HUB_OFFLINE=1 exec vllm serve meta-llama/Llama-3.1-8B-Instruct \\\n  --max-loras 2 -cc.cudagraph_mode=PIECEWISE "
    "\\\n  --max-num-seqs 32 --port 8000  # the line wins over the file\n"
)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("form", ["config", "config and script", "command"])
def test_vllms_parser_and_capplans_reader_make_one_spec_of_a_deployment(version, form, tmp_path):
    _oracle(version)
    (tmp_path / "vllm.yaml").write_text(EXAMPLE)
    (tmp_path / "serve.sh").write_text("#!/bin/sh\n" + LINE)
    section = {
        "config": "{config: vllm.yaml}",
        "config and script": "{config: vllm.yaml, script: serve.sh}",
        "command": "{command: 'vllm serve M --enable-lora --max-loras 3 --max-num-seqs 48 --max-num-batched-tokens 4k "
        "--max-model-len 4096'}",
    }[form]
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(f'deployment: {section}\ntarget: {{vllm: "{version}"}}\n')

    with patch("capplan.launcher.cmdline.read_with_vllm", oracle_reader(version)):
        theirs, found = load_deployed_spec(spec_path)
    assert found is not None and found.reader == VLLM_PARSER
    with patch("capplan.launcher.cmdline.read_with_vllm", return_value=None):
        ours, own = load_deployed_spec(spec_path)
    assert own is not None and own.reader == OWN_READER
    assert ours == theirs and own.fields() == found.fields()
    assert compile_plan(ours).fingerprint == compile_plan(theirs).fingerprint
    if form == "config and script":
        assert (ours.lora.max_loras, ours.scheduler.max_num_seqs, ours.cudagraph.mode.value) == (2, 32, "PIECEWISE")


@pytest.mark.parametrize("version", VERSIONS)
def test_what_only_vllms_parser_reads_is_refused_by_capplans_reader_never_guessed(version, tmp_path):
    _oracle(version)
    spec_path = tmp_path / "spec.yaml"
    line = "vllm serve M --max-num-seqs 48 --max-num-batched-tokens 4096 --max-model-len 4096 -O3"
    spec_path.write_text(f"deployment: {{command: '{line}'}}\ntarget: {{vllm: \"{version}\"}}\n")

    with patch("capplan.launcher.cmdline.read_with_vllm", oracle_reader(version)):
        theirs, found = load_deployed_spec(spec_path)
    assert found is not None and found.fields()["cudagraph.mode"] == theirs.cudagraph.mode.value
    with patch("capplan.launcher.cmdline.read_with_vllm", return_value=None), pytest.raises(SpecError) as err:
        load_deployed_spec(spec_path)
    assert "-O3: capplan's own reader" in err.value.message and err.value.hint == "spell it out in the vLLM config"
