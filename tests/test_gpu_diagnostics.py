"""The GPU runs' Triton compile log (tests/gpu/triton_log), on CPU: a compile during deferred
capture's one-graph call is named by the graph it captures, any other by vLLM's frames."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

from capplan.planfile import load_plan
from capplan.schemas.plan import address

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"


def _module(monkeypatch, folder: Path):
    monkeypatch.delenv("CAPPLAN_TRITON_LOG", raising=False)  # imported off: nothing installed
    spec = importlib.util.spec_from_file_location("triton_log", ROOT / "tests/gpu/triton_log/sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._DIR = str(folder)
    return module


def test_a_compile_inside_a_deferred_capture_names_its_graph(monkeypatch, tmp_path):
    log = _module(monkeypatch, tmp_path)
    plan = load_plan(PLAN)
    compile_fn = log._wrap(lambda src: "compiled")

    class VllmCapture:  # the name and signature of capplan.runtime.deferred.vllm_capture's
        def __init__(self):
            self.ctx = SimpleNamespace(plan=plan)

        def __call__(self, gid, call, manager, capture_fn):
            return compile_fn(SimpleNamespace(fn=SimpleNamespace(__name__="kernel_a")))

    assert VllmCapture()(7, None, None, None) == "compiled"
    assert compile_fn(SimpleNamespace(name="kernel_b")) == "compiled"  # outside any capture
    (written,) = tmp_path.glob("triton-*.jsonl")
    inside, outside = (json.loads(line) for line in written.read_text().splitlines())
    assert inside["kernel"] == "kernel_a" and inside["capture"] == address(plan.graphs[7].descriptor)
    assert outside["kernel"] == "kernel_b" and outside["capture"] is None
    assert oct(written.stat().st_mode & 0o777) == oct(0o644 & ~_umask())


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
