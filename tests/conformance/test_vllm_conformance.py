"""vLLM itself as the oracle: with `fixes: []` the plan equals what each claimed vLLM
release computes (capture sizes, LoRA cases, descriptors in capture order, dummy
layouts, every dispatch decision over a dense grid), and each fix changes exactly
what it claims. Releases: tests/conformance/releases.py (CI runs three; the
matrix, `python -m tests.conformance.matrix`, runs all).

The oracle (oracle/vllm_oracle.py) runs vLLM's real classes on CPU in a
separate venv that `.ci/run` prepares (oracle/setup_oracle.sh). Without it
these tests skip, unless CAPPLAN_REQUIRE_ORACLE=1 (CI) makes that a failure.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from capplan.loading import spec_from_data
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.planner.dispatch import derive_uniform
from tests.conformance import coverage, oracle_python
from tests.conformance.answers import answers
from tests.conformance.answers import run_oracle as run_oracle  # the oracle scripts' one run, for other tests
from tests.conformance.releases import releases
from tests.conformance.specs import BASE_SPECS, queries_for, versioned_specs

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = oracle_python.ORACLE_DIR
ORACLE = Path(__file__).parent / "oracle" / "vllm_oracle.py"
VERSIONS = releases()
SPECS = versioned_specs(VERSIONS)
CROSS_RELEASE = "0.33.0"  # the 0.25 + fixes plans are compared with this release's own behaviour

pytestmark = pytest.mark.conformance


def _oracle_ready(version: str) -> bool:
    return oracle_python.PYTHON.exists() and (ORACLE_DIR / "src" / version / "vllm").is_dir()


def _missing(reason: str):
    if os.environ.get("CAPPLAN_REQUIRE_ORACLE") == "1":
        pytest.fail(f"vLLM oracle required but {reason}")
    pytest.skip(f"vLLM oracle not available ({reason}); run .ci/run")


def run_check(script: str, version: str, *args: object) -> None:
    """Run a check script of tests/conformance with vLLM `version`'s sources and capplan on
    the oracle's Python (it writes its report where its arguments say)."""
    job = oracle_python.run([Path(__file__).parent / script, *args], version=version, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]


@pytest.fixture(scope="session")
def oracle_results() -> dict[str, dict]:
    """vLLM's answer for every spec of the run (tests/conformance/answers.py: cached, verified)."""
    results: dict[str, dict] = {}
    for version in VERSIONS:
        if not _oracle_ready(version):
            _missing(f"{ORACLE_DIR}/src/{version} is missing")
        items = [
            {"name": name, "spec": _normalized(spec, name), "queries": queries_for(spec, seed=_seed(name))}
            for name, oracle, spec in SPECS
            if oracle == version
        ]
        items += [
            {"name": name, "spec": _normalized(spec, name), "queries": queries_for(spec, seed=_seed(name))}
            for name, spec in _cross_version_specs()
            if version == CROSS_RELEASE
        ]
        results.update(answers(ORACLE, version, items, list_key="specs"))
    return results


def _normalized(raw: dict, name: str) -> dict:
    """Every key present, as the oracle expects."""
    return spec_from_data(raw, name).model_dump(mode="json")


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _row(desc) -> list:
    return [
        desc.cg_mode,
        desc.num_tokens,
        desc.num_reqs,
        desc.uniform_token_count,
        desc.max_query_len,
        desc.num_active_loras,
    ]


def _expand_tokens(runs) -> list[int]:
    return [tokens for count, tokens in runs for _ in range(count)]


def _expand_ids(ids, num_reqs) -> list[int] | None:
    if ids is None:
        return None
    # vLLM's prompt mapping uses 0 for "no adapter"; the kernels see it as -1.
    return [max(ids[i % len(ids)], 0) for i in range(num_reqs)]


def test_conformance_covers_enough_specs():
    assert len(BASE_SPECS) >= 30
    modes = {s["cudagraph"]["mode"] for s in BASE_SPECS.values()}
    assert len(modes) == 5
    assert {s["speculative"]["num_speculative_tokens"] for s in BASE_SPECS.values()} >= {0, 1, 2, 3}
    assert {s["parallel"]["data_parallel_size"] for s in BASE_SPECS.values()} >= {1, 2, 4}


@pytest.mark.parametrize("name, oracle, raw", SPECS, ids=[s[0] for s in SPECS])
def test_plan_equals_vllm(oracle_results, name, oracle, raw):
    got = oracle_results[name]
    assert "error" not in got, got.get("error")
    spec = spec_from_data(raw, name)
    plan = compile_plan(spec)
    assert plan.capture_sizes == got["capture_sizes"]
    assert plan.max_capture_size == got["max_capture_size"]
    assert plan.lora_capture_cases == got["lora_capture_cases"]
    assert {str(k): v for k, v in plan.lora_dispatch_map.items()} == got["lora_dispatch_map"]
    assert [_row(d) for d in plan.descriptors] == got["descriptors"]

    for graph, dummy in zip(plan.graphs, got["dummies"], strict=True):
        assert graph.dummy.num_reqs == dummy["num_reqs"], graph
        assert _expand_tokens(graph.dummy.tokens) == dummy["tokens_per_req"], graph
        if dummy["hook_tokens_per_req"] is not None:  # vLLM installs the hook only with LoRA
            assert _expand_tokens(graph.dummy.tokens) == dummy["hook_tokens_per_req"], graph
        assert _expand_ids(graph.dummy.lora_ids, graph.dummy.num_reqs) == dummy["lora_ids"], graph

    dispatcher = Dispatcher(plan)
    queries = queries_for(raw, seed=_seed(name))
    assert len(queries) == len(got["dispatch"]) > 1000
    mismatches = []
    for (r, t, q, k, prefill), want, want_u in zip(queries, got["dispatch"], got["uniform"], strict=True):
        batch = Batch(r, t, q, k, False, prefill)
        assert derive_uniform(batch, spec.rules) == want_u, (r, t, q, prefill)
        have = _row(dispatcher.dispatch(batch))
        if have != want:
            mismatches.append(((r, t, q, k, prefill), have, want))
    assert not mismatches, f"{len(mismatches)} dispatch mismatches, first: {mismatches[:3]}"
    coverage.compared(
        "planning",
        name.split("@")[0],
        oracle,
        {
            "capture_sizes": 1,
            "max_capture_size": 1,
            "lora_capture_cases": 1,
            "lora_dispatch_map": 1,
            "descriptors": len(plan.descriptors),
            "dummies": len(plan.graphs),
            "uniform": len(queries),
            "dispatch": len(queries),
        },
    )


# --- each fix changes exactly what it claims ------------------------------------


def _cross_version_specs() -> list[tuple[str, dict]]:
    """Explicit capture sizes make 0.25 and 0.33 capture the same graphs, so a
    0.25 plan with mixed_ranges + dummy_remainder must behave like vLLM 0.33."""
    out = []
    for name in ("explicit-sizes", "explicit-sizes-spec2", "explicit-sizes-fdo", "spec2-lora4-active"):
        base = dict(BASE_SPECS[name])
        if base["cudagraph"]["capture_sizes"] is None:
            base["cudagraph"] = {**base["cudagraph"], "capture_sizes": [1, 2, 4, 8, 16, 24, 32, 40, 48]}
        out.append((f"cross:{name}", {**base, "target": {**base["target"], "vllm": "0.33"}, "fixes": []}))
    return out


CROSS = _cross_version_specs()


@pytest.mark.parametrize("name, raw", CROSS, ids=[c[0] for c in CROSS])
def test_025_with_fixes_behaves_like_vllm_033(oracle_results, name, raw):
    if CROSS_RELEASE not in VERSIONS:
        pytest.skip(f"vLLM {CROSS_RELEASE} is not in this run's releases")
    got = oracle_results[name]
    spec = spec_from_data(
        {**raw, "target": {**raw["target"], "vllm": "0.25"}, "fixes": ["dummy_remainder", "mixed_ranges"]}, name
    )
    plan = compile_plan(spec)
    assert [_row(d) for d in plan.descriptors] == got["descriptors"]
    assert [_expand_tokens(g.dummy.tokens) for g in plan.graphs] == [d["tokens_per_req"] for d in got["dummies"]]
    dispatcher = Dispatcher(plan)
    queries = queries_for(raw, seed=_seed(name))
    checked = 0
    for (r, t, q, k, prefill), want in zip(queries, got["dispatch"], strict=True):
        if prefill:  # 0.25 never looks at prefill; 0.33 does: not part of this fix
            continue
        assert _row(dispatcher.dispatch(Batch(r, t, q, k, False, False))) == want, (r, t, q, k)
        checked += 1
    assert checked > 500
    fields = {"descriptors": len(plan.descriptors), "dummies": len(plan.graphs), "dispatch": checked}
    coverage.compared("fixes", f"{name} (dummy_remainder, mixed_ranges)", CROSS_RELEASE, fields)


@pytest.mark.parametrize(
    "name, oracle, raw", [s for s in SPECS if "active" in s[0]], ids=[s[0] for s in SPECS if "active" in s[0]]
)
def test_lora_slot_dispatches_by_kernel_slots(oracle_results, name, oracle, raw):
    """With lora_slot, k adapters + base dispatch exactly like vLLM dispatches
    k + 1 adapters; without base requests nothing changes."""
    got = oracle_results[name]
    spec = spec_from_data({**raw, "fixes": ["lora_slot"]}, name)
    plan = compile_plan(spec)
    exact = compile_plan(spec_from_data(raw, name))
    assert plan.descriptors == exact.descriptors and plan.dispatch == exact.dispatch
    dispatcher = Dispatcher(plan)
    by_query = {tuple(q): want for q, want in zip(queries_for(raw, seed=_seed(name)), got["dispatch"])}
    compared = 0
    for (r, t, q, k, prefill), want in by_query.items():
        assert _row(dispatcher.dispatch(Batch(r, t, q, k, False, prefill))) == want
        shifted = by_query.get((r, t, q, k + 1, prefill))
        if 0 < k < r and shifted is not None:
            assert _row(dispatcher.dispatch(Batch(r, t, q, k, True, prefill))) == shifted
            compared += 1
    assert compared > 0
    fields = {"dispatch": len(by_query), "dispatch_with_base_requests": compared}
    coverage.compared("fixes", f"{name.split('@')[0]} (lora_slot)", oracle, fields)
