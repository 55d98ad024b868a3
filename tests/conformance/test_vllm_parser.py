"""`capplan apply` reads a launch line with vLLM's own argument parser where vLLM is importable:
every spelling vLLM accepts, a --config file, repeated flags and -O levels are resolved by vLLM,
compared with the plan, and nothing the operator gave is overridden. Run against the parsers of
0.25.0, 0.29.0 and 0.33.0 (the oracle's vLLM sources on CPU)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capplan.errors import CapplanError
from capplan.launcher.cmdline import read_with_vllm
from capplan.launcher.engine_args import prepare
from capplan.planfile import load_plan
from tests.conformance.test_vllm_conformance import ORACLE_DIR, _missing, _oracle_ready

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"  # max_num_seqs 256, 8192 tokens, max_loras 8
VERSIONS = ("0.25.0", "0.29.0", "0.33.0")
# Each release's parser is forked from the run's server for it (vLLM imported once); the last test
# checks that route gives what a fresh process, as capplan runs it, gives.
pytestmark = pytest.mark.usefixtures("vllm_parser_in_fork_server")

# (engine arguments after `vllm serve M`, a config file's text or None, the verdict: a substring of
# the refusal, or "ok" and a substring of what capplan adds)
CORPUS = [
    (["--config", "{cfg}"], "max_loras: 4\nmax_num_seqs: 256\n", "--max-loras 4 (in --config"),
    (["--config", "{cfg}"], "max_num_seqs: 256\nmax_loras: 8\n", ("ok", "--max-num-batched-tokens 8192")),
    (["--max_loras", "4"], None, "--max-loras 4: the plan has lora.max_loras 8"),
    (["--max-num-seq", "16"], None, "--max-num-seqs 16: the plan has scheduler.max_num_seqs 256"),
    (["--enforce-eag"], None, "--enforce-eager runs no CUDA graph"),
    (["--max-num-seqs", "256", "--max-num-seqs", "16"], None, "--max-num-seqs 16"),
    (["--max-num-seqs", "16", "--max-num-seqs", "256"], None, ("ok", "--max-loras 8")),
    (["--max-num-batched-tokens", "8k"], None, "--max-num-batched-tokens 8000"),
    (["--max-num-batched-tokens", "8K"], None, ("ok", "--max-loras 8")),
    (["-cc", '{"cudagraph_mode": "full_and_piecewise"}'], None, ("ok", "cudagraph_capture_sizes (in -cc)")),
    (["-cc", '{"cudagraph_mode": "PIECEWISE"}'], None, "cudagraph_mode PIECEWISE: the plan has cudagraph.mode"),
    (["--bogus-flag", "1"], None, "vLLM's argument parser refuses the command"),
    (["--config", "{cfg}"], "compilation_config:\n  cudagraph_mode: FULL_AND_PIECEWISE\n", "in its --config file"),
    (["--spec-method", "ngram", "--spec-tokens", "3"], None, "--spec-tokens 3: the plan has speculative"),
    (["-O1"], None, "cudagraph mode PIECEWISE): the plan has cudagraph.mode FULL_AND_PIECEWISE"),
    (["-O", "3"], None, ("ok", "--max-loras 8")),
    (["-cc", '{"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 1k}'], None, "cudagraph_mode FULL:"),
    (["--compilation_config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None, ("ok", "(in --compilation_config)")),
    (["-cc", "{}", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None, ("ok", "(in -cc)")),
    # one line per pinned setting, against the plan
    (["-dp", "2"], None, "--data-parallel-size 2: the plan has parallel.data_parallel_size 1"),
    (["--max-model-len", "16384"], None, "--max-model-len 16384: the plan has scheduler.max_model_len 32768"),
    (["--max-model-len", "32k"], None, "--max-model-len 32000"),
    (["--max-model-len", "32K"], None, ("ok", "--max-loras 8")),
    (["--no-enable-lora"], None, "the plan has lora.enabled"),
    (["--no-specialize-active-lora"], None, "the plan has lora.specialize_active"),
    (["--cudagraph-capture-sizes", "1", "2", "4"], None, "the plan has cudagraph.capture_sizes"),
    (["-cc.cudagraph_specialize_lora=false"], None, "the plan has lora.specialize"),
    (["--max-cudagraph-capture-size", "8"], None, "the plan's largest graph is"),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'], None, "speculative"),
    (["--config", "{cfg}"], "max_num_batched_tokens: 4096\n", "4096 (in --config"),
    (["--config", "{cfg}"], "enable_lora: true\nmax_loras: 8\n", ("ok", "--max-num-seqs 256")),
    # a setting no spec field gives: only vLLM's default
    (["-pcp", "2"], None, "2: capplan plans no prefill context parallelism"),
    (["--config", "{cfg}"], "prefill_context_parallel_size: 2\n", "capplan plans no prefill context parallelism"),
    (["--prefill-context-parallel-size", "1"], None, ("ok", "--max-loras 8")),
    (["--enable-dbo"], None, "capplan plans no dual batch overlap"),
    (["--config", "{cfg}"], "enable_elastic_ep: true\n", "capplan plans no elastic expert parallelism"),
    (["--no-enable-dbo", "--no-enable-elastic-ep"], None, ("ok", "--max-loras 8")),
]


def _env(version: str) -> dict[str, str]:
    # vLLM recognizes a CPU build by its package version ("+cpu"); the oracle's sources carry no
    # package metadata, so the test gives them one (0.25.0 has no other way to pick the CPU platform),
    # in one folder per release beside the oracle's, so that every test of a release meets one
    # environment (and one fork server).
    meta = ORACLE_DIR / "meta" / version
    info = meta / f"vllm-{version}+cpu.dist-info"
    if not (info / "METADATA").exists():
        info.mkdir(parents=True, exist_ok=True)
        text = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        with tempfile.NamedTemporaryFile("w", dir=info, delete=False) as new:
            new.write(text)
        os.chmod(new.name, 0o644)
        os.replace(new.name, info / "METADATA")  # whole, whichever worker writes it
    path = os.pathsep.join(map(str, (ORACLE_DIR / "src" / version, meta)))
    return {**os.environ, "PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu"}


@pytest.mark.parametrize("version", VERSIONS)
def test_launch_lines_are_read_by_vllms_own_parser(version, tmp_path, monkeypatch):
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    for key, value in _env(version).items():
        monkeypatch.setenv(key, value)
    plan = load_plan(PLAN)
    python = str(ORACLE_DIR / "venv" / "bin" / "python")
    failures: list[str] = []
    argvs, completed = [], []
    for i, (args, config, _) in enumerate(CORPUS):
        cfg = tmp_path / f"vllm{i}.yaml"
        if config is not None:
            cfg.write_text(config)
        argvs.append(["vllm", "serve", "M", *(a.replace("{cfg}", str(cfg)) for a in args)])
    results = read_with_vllm(python, argvs, dict(os.environ))  # vLLM imported once
    assert results is not None, "vLLM's parser did not import in the oracle"
    for argv, result, (args, config, verdict) in zip(argvs, results, CORPUS, strict=True):
        try:
            full, lines = prepare(plan, "p.plan.yaml", argv, python=python, resolution=result)
        except CapplanError as exc:
            got = exc.one_line()
            if isinstance(verdict, tuple) or verdict not in got:
                failures.append(f"{args}: refused: {got}")
            continue
        said = " ".join(lines)
        if not isinstance(verdict, tuple) or verdict[1] not in said or "own reader" in said:
            failures.append(f"{args}: accepted ({said}), expected {verdict}")
        if config is not None and "max_num_seqs" in config and "--max-num-seqs" in full[len(argv) :]:
            failures.append(f"{args}: a value the --config file gives was added again: {full[len(argv) :]}")
        completed.append(full)
    # Every completed command is one vLLM's parser accepts, consistent with the plan, with nothing left to add.
    again = read_with_vllm(python, completed, dict(os.environ))
    assert again is not None
    for full, result in zip(completed, again, strict=True):
        try:
            _, lines = prepare(plan, "p.plan.yaml", full, python=python, resolution=result)
        except CapplanError as exc:
            failures.append(f"completed {full[3:]}: refused: {exc.one_line()}")
            continue
        if any("added from the plan" in line for line in lines):
            failures.append(f"completed {full[3:]}: still incomplete: {lines}")
    assert failures == []


_WORDS = st.sampled_from(
    ["--max-num-seqs", "--max_loras", "-O", "-O0", "-O3", "--config", "-cc", "-cc.cudagraph_mode", "-sc",
     "--enforce-eager", "--no-enable-lora", "--max-model-len", "auto", "-1", "8k", "9" * 40, "4_096", "{", "[1,",
     '{"cudagraph_mode": 2}', '{"cudagraph_capture_sizes": [1, "a"]}', "--max-num", "--", "é", "\x00x",
     "--tensor-parallel-size", "0", "--speculative-config", '{"num_speculative_tokens": "2"}', "-pcp",
     "--prefill-context-parallel-size"]
)  # fmt: skip


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(st.one_of(_WORDS, st.text(max_size=12)), max_size=6), min_size=25, max_size=25))
def test_any_launch_line_gets_a_verdict_in_one_line(lines):
    """Generated launch lines through vLLM 0.33.0's parser: each is accepted or refused in one
    line (a CapplanError), never a traceback."""
    version = "0.33.0"
    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    argvs = [["vllm", "serve", "M", *line] for line in lines]
    results = read_with_vllm(str(ORACLE_DIR / "venv" / "bin" / "python"), argvs, _env(version))
    assert results is not None and len(results) == len(argvs)
    plan = load_plan(PLAN)
    for argv, result in zip(argvs, results, strict=True):
        try:
            prepare(plan, "p.plan.yaml", argv, python="python", resolution=result)
        except CapplanError as exc:
            assert "\n" not in exc.one_line()


@pytest.mark.parametrize(
    ("version", "metadata"), [(VERSIONS[0], False), (VERSIONS[-1], True)], ids=("no-metadata", "cpu-metadata")
)
def test_the_fork_server_gives_what_a_fresh_process_gives(version, metadata, tmp_path):
    """The route the parser tests take (vLLM's parser forked from the run's server) answers every
    line of the corpus exactly as `capplan apply` running vLLM's Python afresh does: without
    package metadata (as test_launch_corpus.py and test_init_roundtrip.py run it, where vLLM
    infers no device and the server is the other checks') on the oldest parser, and with the CPU
    metadata these tests give on the newest. (All four pairs agreed when this was written.)"""
    from tests.conformance import oracle_python

    if not _oracle_ready(version):
        _missing(f"{ORACLE_DIR}/src/{version} is missing")
    env = _env(version) if metadata else {**os.environ, "PYTHONPATH": str(ORACLE_DIR / "src" / version)}
    argvs = []
    for i, (args, config, _) in enumerate(CORPUS):
        cfg = tmp_path / f"vllm{i}.yaml"
        if config is not None:
            cfg.write_text(config)
        argvs.append(["vllm", "serve", "M", *(a.replace("{cfg}", str(cfg)) for a in args)])
    python = str(ORACLE_DIR / "venv" / "bin" / "python")
    forks = len(oracle_python.FORKED_PARSER_RUNS)
    forked = read_with_vllm(python, argvs, env)
    assert len(oracle_python.FORKED_PARSER_RUNS) == forks + 1  # the fork server answered, not a fallback
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("capplan.launcher.vllm_cli.run_script", oracle_python.AS_CAPPLAN_RUNS_IT)
        fresh = read_with_vllm(python, argvs, env)
    assert forked is not None and fresh is not None and len(forked) == len(argvs)
    assert forked == fresh
