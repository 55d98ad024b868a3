"""`bench/capture_hook.py` runs against vLLM's real `create_lora_capture_hook` (0.33.0 on CPU):
both hooks warm every LoRA graph of the qwen3 example the same number of times, and the bench
prints its ratio. Its timings are for docs/benchmarks.md; here only that it runs."""

from __future__ import annotations

from pathlib import Path

from tests.conformance import oracle_python
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

ROOT = Path(__file__).resolve().parents[2]


def test_the_capture_hook_bench_runs_on_vllms_hook():
    version = "0.33.0"
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    job = oracle_python.run([ROOT / "bench" / "capture_hook.py"], version=version, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "410 LoRA graphs of qwen3-8b-multilora.plan.yaml" in job.stdout and "ratio" in job.stdout, job.stdout
