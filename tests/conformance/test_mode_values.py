"""A cudagraph mode as capplan's own launch reader reads it (`launcher.cmdline._mode`) against vLLM's
CompilationConfig on the same value: the same mode, or both refuse."""

from __future__ import annotations

import json

import pytest

from capplan.errors import CapplanError
from capplan.launcher.cmdline import _mode
from tests.conformance import oracle_python
from tests.conformance.test_vllm_conformance import _missing, _oracle_ready

pytestmark = pytest.mark.conformance
VALUES = ["full", "piecewise", "FULL", "Full_And_Piecewise", "full_decode_only", "none", "NONE", 0, 1, 2, 2.0,
          True, False, 7, -1, 2.5, "2", "bogus", "", "FULL "]  # fmt: skip
SCRIPT = """
import json, sys
from vllm.config.compilation import CompilationConfig
out = []
for v in json.loads(sys.argv[1]):
    try:
        out.append(CompilationConfig(cudagraph_mode=v).cudagraph_mode.name)
    except Exception:
        out.append(None)
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_the_own_reader_reads_a_cudagraph_mode_as_vllm_does(version):
    if not _oracle_ready(version):
        _missing(f"vLLM {version}'s sources")
    job = oracle_python.run(["-c", SCRIPT, json.dumps(VALUES)], version=version, timeout=600)
    assert job.returncode == 0, job.stderr[-2000:]
    theirs = json.loads(job.stdout.strip().splitlines()[-1])
    ours = []
    for v in VALUES:
        try:
            ours.append(_mode("-cc cudagraph_mode", v))
        except CapplanError:
            ours.append(None)
    assert ours == theirs
    assert theirs[:3] == ["FULL", "PIECEWISE", "FULL"] and theirs[VALUES.index(7)] is None
