"""Launch lines read by both of `capplan apply`'s readers, judged by vLLM's own parser: vLLM's
(0.25.0, 0.29.0 and 0.33.0, run on CPU, the way the `vllm` command runs it, on a machine where
vLLM infers no device), and capplan's own (where vLLM is not importable). On every line the own
reader either completes the command exactly as vLLM's reading does, or refuses; it never
completes a line vLLM refuses, and never gives a third answer. Each release reads the whole
corpus, and the generated lines, in one run of its Python (vLLM imported once)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from capplan.errors import CapplanError
from capplan.launcher.cmdline import read_with_vllm
from capplan.launcher.engine_args import prepare
from capplan.planfile import load_plan

ROOT = Path(__file__).resolve().parents[2]
PLAN = load_plan(
    ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
)  # 256 seqs, 8192 tokens, 8 LoRAs, FULL_AND_PIECEWISE
ORACLE_DIR = Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
PYTHON = ORACLE_DIR / "venv" / "bin" / "python"
VERSIONS = ("0.25.0", "0.29.0", "0.33.0")
SIZES = json.dumps(PLAN.capture_sizes)

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_parser_in_fork_server")]

# (arguments after `vllm serve M`, the --config file's text or None); {cfg} is the file
CORPUS: list[tuple[list[str], str | None]] = [
    # --config files: every value counts as the operator's
    (["--config", "{cfg}"], "max-num-seqs: 8\n"),
    (["--config", "{cfg}"], "max_num_seqs: 256\nmax_loras: 8\n"),
    (["--config", "{cfg}"], "max-loras: 4\n"),
    (["--config", "{cfg}"], "max-model-len: 16384\n"),
    (["--config", "{cfg}"], "data-parallel-size: 2\n"),
    (["--config", "{cfg}"], "tensor-parallel-size: 2\n"),
    (["--config", "{cfg}"], "enforce-eager: true\n"),
    (["--config", "{cfg}"], "enforce_eager: false\n"),
    (["--config", "{cfg}"], "enable-lora: false\n"),
    (["--config", "{cfg}"], "optimization-level: 0\n"),
    (["--config", "{cfg}"], "spec-tokens: 3\nspec-method: ngram\n"),
    (["--config", "{cfg}"], "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n"),
    (["--config", "{cfg}"], "compilation-config:\n  cudagraph_mode: PIECEWISE\n"),
    (["--config", "{cfg}"], "compilation-config:\n  cudagraph_mode: FULL_AND_PIECEWISE\n"),
    (["--config", "{cfg}"], "compilation_config.cudagraph_mode: FULL_AND_PIECEWISE\n"),
    (["--config", "{cfg}"], "cudagraph-capture-sizes: [1, 2, 4]\n"),
    (["--config", "{cfg}"], "max-num-batched-tokens: 8k\n"),
    (["--config", "{cfg}"], "max-num-batched-tokens: 8K\n"),
    (["--config", "{cfg}"], "max-num-se: 8\n"),
    (["--config", "{cfg}"], "port: 8000\nseed: 1\n"),
    (["--config", "{cfg}", "--max-num-seqs", "256"], "max-num-seqs: 8\n"),
    (["--max-num-seqs", "256", "--config", "{cfg}"], "max-num-seqs: 8\n"),
    (["--config", "{cfg}", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], "compilation-config:\n  mode: 3\n"),
    (["--config", "{cfg}"], "- max-num-seqs\n"),
    (["--config", "{cfg}"], "max-num-seqs: [8\n"),
    # optimization levels, in every spelling vLLM's parser takes
    (["-O0"], None),
    (["-O", "0"], None),
    (["-O3"], None),
    (["-O=1"], None),
    (["--optimization-level=1"], None),
    (["--optimization_level", "2"], None),
    (["-O1", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None),
    # flag spellings
    (["--max_num_seqs", "8"], None),
    (["--max_num_seqs=256"], None),
    (["--max-num-seqs=8"], None),
    (["--compilation_config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None),
    (["--compilation_config.cudagraph_mode=PIECEWISE"], None),
    (["--max-num-batched-tokens", "1.5K"], None),
    (["--max-num-batched-tokens", "8k"], None),
    (["--enable-lora", "--disable-lora"], None),
    (["--no-enable-lora"], None),
    (["--enforce-eager=true"], None),
    (["--cudagraph-capture-sizes", "1", "2", "x"], None),
    (["--cudagraph-capture-sizes", *map(str, PLAN.capture_sizes)], None),
    # abbreviations
    (["--max-num-se", "8"], None),
    (["--max-num-seq", "256"], None),
    (["--enforce-eag"], None),
    (["--max-lo", "4"], None),
    (["--conf", "{cfg}"], "max-num-seqs: 8\n"),
    (["--compilation.cudagraph_mode", "PIECEWISE"], None),
    (["-t", "2"], None),
    # JSON configs: the last object wins, dotted keys replace it
    (["-cc", '{"cudagraph_mode": "PIECEWISE"}', "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], None),
    (["-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "-cc", "{}"], None),
    (["-cc", '{"cudagraph_mode": "PIECEWISE"}', "-cc.max_cudagraph_capture_size=512"], None),
    (["-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "-cc.compile_sizes=[8]"], None),
    (["-cc.cudagraph_mode=FULL_AND_PIECEWISE", "-cc.max_cudagraph_capture_size=1k"], None),
    (["-cc", json.dumps({"cudagraph_capture_sizes": [True, 2, 4]})], None),
    (TRUE_IS_ONE := ["-cc", json.dumps({"cudagraph_capture_sizes": [True, *PLAN.capture_sizes[1:]]})], None),
    (["-cc", json.dumps({"cudagraph_capture_sizes": [1, "a"]})], None),
    (["-cc", f'{{"cudagraph_capture_sizes": {SIZES}}}'], None),
    # a list key's `+` form: vLLM splits the value at commas into strings, joins repeats, and its
    # pydantic model reads each string of digits as an integer
    (PLUS := [f"-cc.cudagraph_capture_sizes+={','.join(map(str, PLAN.capture_sizes))}"], None),
    (
        PLUS_SPLIT := [
            f"-cc.cudagraph_capture_sizes+={','.join(map(str, PLAN.capture_sizes[:9]))}",
            f"-cc.cudagraph_capture_sizes+={','.join(map(str, PLAN.capture_sizes[9:]))}",
        ],
        None,
    ),  # fmt: skip
    (["-cc.cudagraph_capture_sizes+=1,two"], None),
    # the performance mode: vLLM's default is the plan's; another derives other default sizes
    (["--performance-mode", "balanced"], None),
    (["--performance-mode=interactivity"], None),
    (["--performance-mode", "fast"], None),
    (["--config", "{cfg}"], "performance-mode: throughput\n"),
    # the dtype: read (the spec's model.dtype), never added
    (["--dtype", "half"], None),
    (["--dtype=bfloat16"], None),
    (["--dtype", "bf16"], None),
    # the model, and a bare --
    (["--model", "other"], None),
    (["--", "--max-num-seqs", "8"], None),
    (["--spec-tokens", "2", "--spec-method", "ngram"], None),
    (["--port", "8000", "--seed", "1", "--trust-remote-code"], None),
    # a limit left to the model
    (["--max-model-len", "auto"], None),
    (["--max-model-len", "32K", "--max-model-len", "auto"], None),
    (["--config", "{cfg}"], "max-model-len: auto\n"),
    (["-tp4"], None),
    (["--enable-lora", "yes"], None),
    (["--lora-modules", "a=/x", "b=/y", "--max-num-seqs", "256"], None),
    (["--no-disable-lora"], None),
    # what vLLM's option tables settle: values taken, off forms, options some releases lack
    (["--served-model-name", "--max-num-seqs", "8"], None),
    (["--port"], None),
    (["--lora-modules", "--max-num-seqs", "8"], None),
    (["--seed", "-1e5", "--max-num-seqs", "8"], None),
    (["--seed", "-1", "--max-num-seqs", "8"], None),
    (["--served-model-name", "x", "-1.5", "--max-num-seqs", "8"], None),
    (["--gpu-memory-utilization", "-0.5", "--max-num-seqs", "8"], None),
    (["--trust-remote-code=1"], None),
    (["-n2", "--max-num-seqs", "8"], None),
    (["--no-enable-lora", "--max-num-seqs", "8"], None),
    (["--disable-lora"], None),
    (["--lora-mod", "a=/x"], None),
    (["--calculate-kv-scales", "--max-num-seqs", "8"], None),
    (["--config", "{cfg}", "8"], "max-num-seqs: true\n"),
]
FORMS = [["vllm", "serve", "M"], ["vllm", "serve"], ["python", "-m", "vllm.entrypoints.openai.api_server"]]


def _env(version: str) -> dict[str, str]:
    # no package metadata: vLLM infers no device, as on a review machine without a GPU
    return {**os.environ, "PYTHONPATH": str(ORACLE_DIR / "src" / version)}


def _verdict(argv: list[str], resolution: dict | None) -> tuple[str, str]:
    """("ok", the completed command) or ("refused", the one line)."""
    try:
        if resolution is None:  # capplan's own reader, as where vLLM is not importable
            with patch("capplan.launcher.engine_args.read_with_vllm", return_value=None):
                full, _ = prepare(PLAN, "p.plan.yaml", argv)
        else:
            full, _ = prepare(PLAN, "p.plan.yaml", argv, python=str(PYTHON), resolution=resolution)
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return "refused", exc.one_line()
    return "ok", json.dumps(full)


# Generated lines: settings the plan pins, in the spellings and places vLLM's parser reads
# them, with the plan's value or another, on the line or in a --config file.
_CLI = (
    ["--max-num-seqs", "256"], ["--max-num-seqs", "8"], ["--max_num_seqs", "8"], ["--max-num-seqs=256"],
    ["--max-num-seq", "8"], ["--max-loras", "8"], ["--max_loras=4"], ["--max-num-batched-tokens", "8K"],
    ["--max-num-batched-tokens", "8k"], ["--enforce-eager"], ["--no-enforce-eager"], ["--enforce-eag"],
    ["--enable-lora"], ["--no-enable-lora"], ["--disable-lora"], ["-O0"], ["-O", "3"], ["-O=2"],
    ["--optimization-level", "1"], ["-cc", '{"cudagraph_mode": "PIECEWISE"}'],
    ["-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], ["--compilation_config", "{}"],
    ["-cc.cudagraph_mode=FULL_AND_PIECEWISE"], ["-cc.cudagraph_mode", "PIECEWISE"],
    ["--compilation-config.max_cudagraph_capture_size=512"], ["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'],
    ["--spec-tokens", "2"], ["-dp", "1"], ["-dp", "2"], ["--data_parallel_size", "1"], ["--max-model-len", "32K"],
    ["--max-model-len", "32k"], ["--port", "8000"], ["--trust-remote-code"], ["--model", "other"],
    ["--specialize-active-lora"], ["--no-specialize-active-lora"], ["-cc", '{"cudagraph_capture_sizes": [true, 2]}'],
    ["--performance-mode", "interactivity"], ["--performance-mode=throughput"], ["--performance-mode", "Balanced"],
    ["--dtype", "bfloat16"], ["--dtype=half"], ["--dtype", "fp8"], ["-cc.cudagraph_capture_sizes+=1,2,x"],
)  # fmt: skip
_SAME = (  # the plan's own values, in vLLM's spellings
    ["--max-num-seqs", "256"], ["--max_num_seqs=256"], ["--max-loras=8"], ["--max_loras", "8"],
    ["--max-num-batched-tokens", "8K"], ["--max-num-batched-tokens", "8192"], ["--enable-lora"], ["--enable_lora"],
    ["--no-enforce-eager"], ["--specialize-active-lora"], ["-dp", "1"], ["--data_parallel_size=1"],
    ["--max-model-len", "32K"], ["-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE", "compile_sizes": [8]}'],
    ["--compilation_config", '{"cudagraph_mode": "full_and_piecewise"}'], ["-cc.cudagraph_mode=FULL_AND_PIECEWISE"],
    ["-cc.cudagraph_specialize_lora=true"], ["--port", "8000"], ["--trust-remote-code"], ["--seed=1"],
    ["--performance-mode", "balanced"], ["--dtype", "auto"], ["--dtype=float16"],
)  # fmt: skip
_FILE = (
    "max-num-seqs: 8", "max_num_seqs: 256", "max-loras: 4", "max_loras: 8", "enforce-eager: true",
    "enforce-eager: false", "enable-lora: true", "enable_lora: false", "optimization-level: 0",
    "optimization_level: 3", "compilation-config: {cudagraph_mode: PIECEWISE}",
    "compilation_config: {cudagraph_mode: FULL_AND_PIECEWISE}", "compilation-config.cudagraph_mode: PIECEWISE",
    "max-num-batched-tokens: 8K", "max-model-len: 32768", "data-parallel-size: 2", "spec-tokens: 2",
    "cudagraph-capture-sizes: [1, 2]", "port: 8000", "max-num-se: 8", "specialize-active-lora: true",
    "performance-mode: interactivity", "performance_mode: balanced", "dtype: bfloat16", "dtype: bf16",
)  # fmt: skip


def _generated(rnd, count: int) -> list[tuple[int, list[list[str]], list[str] | None, int]]:
    """`count` lines: a form, some pieces, maybe a --config file's entries (one per key) and where it goes."""
    out = []
    for _ in range(count):
        entries = None
        if rnd.random() < 0.5:
            by_key = {e.split(":")[0].replace("_", "-"): e for e in rnd.sample(_FILE, rnd.randint(1, 4))}
            entries = list(by_key.values())
        pieces = [rnd.choice(_SAME if rnd.random() < 0.7 else _CLI) for _ in range(rnd.randint(0, 4))]
        out.append((rnd.randrange(len(FORMS)), pieces, entries, rnd.randint(0, 4)))
    return out


def _lines(generated: list, folder: Path) -> list[list[str]]:
    out = []
    for k, (args, config) in enumerate(CORPUS):
        cfg = folder / f"corpus{k}.yaml"
        if config is not None:
            cfg.write_text(config)
        out.append([*FORMS[0], *(a.replace("{cfg}", str(cfg)) for a in args)])
    for k, (form, pieces, entries, at) in enumerate(generated):
        args = [a for piece in pieces for a in piece]
        if entries is not None:
            cfg = folder / f"generated{k}.yaml"
            cfg.write_text("\n".join(entries) + "\n")
            cut = min(at, len(pieces))
            args = [a for piece in pieces[:cut] for a in piece] + ["--config", str(cfg)]
            args += [a for piece in pieces[cut:] for a in piece]
        head = FORMS[form]
        if head[-1] != "M" and not any(a == "--model" for a in args):
            head = [*head, "--model", "M"] if head[0] == "python" else head
        out.append([*head, *args])
    return out


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=1, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(rnd=st.randoms(use_true_random=True))
def test_both_readers_agree_or_the_own_reader_refuses(version, rnd):
    if not PYTHON.exists() or not (ORACLE_DIR / "src" / version / "vllm").is_dir():
        if os.environ.get("CAPPLAN_REQUIRE_ORACLE") == "1":
            pytest.fail(f"vLLM oracle required but {ORACLE_DIR}/src/{version} is missing")
        pytest.skip(f"vLLM oracle not available ({ORACLE_DIR}/src/{version}); run .ci/run")
    with tempfile.TemporaryDirectory() as tmp:
        lines = _lines(_generated(rnd, 80), Path(tmp))
        results = read_with_vllm(str(PYTHON), lines, _env(version))  # every line, one run of vLLM's Python
        assert results is not None and len(results) == len(lines), "vLLM's parser did not run in the oracle"
        counts = {"agree": 0, "both refuse": 0, "own refuses, vLLM completes": 0}
        wrong: list[str] = []
        for argv, result in zip(lines, results, strict=True):
            assert "Failed to infer device type" not in str(result.get("refused")), result
            theirs, ours = _verdict(argv, result), _verdict(argv, None)
            if argv == [*FORMS[0], "--model", "other"]:  # the vllm command moves --model first: M is left over
                assert theirs[0] == "refused" and "unrecognized arguments: M" in theirs[1], theirs
            if argv == [*FORMS[0], *TRUE_IS_ONE]:  # vLLM reads true as 1: the plan's sizes, completed by both
                assert theirs[0] == "ok" and ours == theirs, (theirs, ours)
            if argv in ([*FORMS[0], *PLUS], [*FORMS[0], *PLUS_SPLIT]):  # the `+` form: the plan's sizes, read by both
                assert theirs[0] == "ok" and ours == theirs, (theirs, ours)
            if ours[0] == "refused":
                counts["both refuse" if theirs[0] == "refused" else "own refuses, vLLM completes"] += 1
                if theirs[0] == "ok":
                    print(f"own reader refuses {argv[1:]}: {ours[1][:120]}")
            elif ours == theirs:
                counts["agree"] += 1
            else:
                wrong.append(f"{argv[1:]}: own {ours[1][:200]} | vLLM {theirs[1][:200]}")
    print(f"vLLM {version}: {len(lines)} lines, {counts}, {len(wrong)} third answers")
    assert not wrong, "\n".join(wrong)
