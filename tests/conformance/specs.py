"""Specs the conformance tier runs through vLLM's own planning code.

Each base spec runs against each release of the run, targeting that release
exactly, with `fixes: []`, covering all five modes, 0-3
speculative tokens, LoRA off/on, both specialize switches, max_loras 1..16,
DP 1/2/4, default and explicit capture sizes, off-stride max_num_seqs.
"""

from __future__ import annotations

import random

L = "lora"


def _spec(
    seqs=256,
    budget=8192,
    mode="FULL_AND_PIECEWISE",
    sizes=None,
    max_size=None,
    lora=None,
    spec_tokens=0,
    dp=1,
    perf="balanced",
    blackwell=False,
    model_len=4096,
):
    return {
        "scheduler": {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "max_model_len": model_len},
        "cudagraph": {"mode": mode, "capture_sizes": sizes, "max_capture_size": max_size, "performance_mode": perf},
        "lora": lora or {"enabled": False},
        "speculative": {"num_speculative_tokens": spec_tokens},
        "parallel": {"data_parallel_size": dp, "moe": True},
        "target": {"runner": "mrv2", "blackwell": blackwell},
    }


def _lora(max_loras, specialize=True, active=False):
    return {"enabled": True, "max_loras": max_loras, "specialize": specialize, "specialize_active": active}


BASE_SPECS: dict[str, dict] = {
    "default": _spec(),
    "lora4": _spec(lora=_lora(4)),
    "lora4-active": _spec(lora=_lora(4, active=True)),
    "lora4-nospecialize": _spec(lora=_lora(4, specialize=False)),
    "lora4-nospecialize-active": _spec(lora=_lora(4, specialize=False, active=True)),
    "lora1-active": _spec(seqs=32, budget=2048, lora=_lora(1, active=True)),
    "lora3-active-spec1": _spec(seqs=64, budget=4096, lora=_lora(3, active=True), spec_tokens=1),
    "lora16-active": _spec(seqs=128, budget=8192, lora=_lora(16, active=True)),
    "lora8-active-dp2": _spec(seqs=64, budget=4096, lora=_lora(8, active=True), dp=2),
    "tiny-llama-h200": _spec(seqs=32, budget=2048, model_len=512, lora=_lora(4, active=True)),
    "piecewise": _spec(mode="PIECEWISE", seqs=100, budget=4096),
    "piecewise-lora2": _spec(mode="PIECEWISE", seqs=48, budget=2048, lora=_lora(2, active=True)),
    "full": _spec(mode="FULL", seqs=64, budget=4096),
    "full-lora4-spec2": _spec(mode="FULL", seqs=37, budget=2048, lora=_lora(4, active=True), spec_tokens=2),
    "full-decode-only": _spec(mode="FULL_DECODE_ONLY", seqs=128),
    "full-decode-only-spec3": _spec(mode="FULL_DECODE_ONLY", seqs=64, spec_tokens=3, lora=_lora(2)),
    "none": _spec(mode="NONE", lora=_lora(4)),
    "spec1": _spec(seqs=128, spec_tokens=1),
    "spec2-lora4-active": _spec(seqs=8, budget=2048, spec_tokens=2, lora=_lora(4, active=True)),
    "spec3": _spec(seqs=96, budget=8192, spec_tokens=3),
    "spec3-dp4": _spec(seqs=200, budget=8192, spec_tokens=3, dp=4, lora=_lora(2, active=True)),
    "offstride-seqs": _spec(seqs=37, budget=3000),
    "offstride-seqs-spec2": _spec(seqs=100, budget=6000, spec_tokens=2, lora=_lora(5, active=True)),
    "budget-below-ceiling": _spec(seqs=256, budget=300, lora=_lora(2)),
    "explicit-sizes": _spec(sizes=[1, 2, 3, 5, 8, 13, 21, 34, 55, 89], lora=_lora(4, active=True)),
    "explicit-sizes-spec2": _spec(seqs=16, budget=1024, sizes=[1, 2, 4, 8, 16, 32, 64], spec_tokens=2),
    "explicit-sizes-fdo": _spec(mode="FULL_DECODE_ONLY", seqs=64, sizes=[4, 7, 16, 30, 64, 100], spec_tokens=1),
    # a given size above the token budget: vLLM drops it and captures the rest
    "explicit-sizes-over-budget": _spec(seqs=64, budget=256, sizes=[1, 2, 4, 8, 16, 512], lora=_lora(2)),
    "max-capture-size": _spec(max_size=128, lora=_lora(2)),
    "max-capture-size-offgrid": _spec(max_size=300, spec_tokens=1),
    "interactivity": _spec(seqs=64, perf="interactivity", lora=_lora(4, active=True)),
    "blackwell": _spec(seqs=1024, budget=16384, blackwell=True, spec_tokens=1),
    "one-seq": _spec(seqs=1, budget=512, lora=_lora(2, active=True), spec_tokens=1),
    "big-dp8": _spec(seqs=1024, budget=16384, max_size=1024, spec_tokens=3, lora=_lora(32, active=True), dp=8),
}


def versioned_specs(releases: tuple[str, ...]) -> list[tuple[str, str, dict]]:
    """(name, vLLM release, spec with fixes []) for each release, the spec targeting that
    release exactly."""
    out = []
    for release in releases:
        for name, base in BASE_SPECS.items():
            spec = {**base, "target": {**base["target"], "vllm": release}, "fixes": []}
            out.append((f"{name}@{release}", release, spec))
    return out


def queries_for(spec: dict, seed: int) -> list[list]:
    """[num_reqs, num_tokens, max_query_len, num_adapters, has_prefill] covering
    every boundary region of the capture grid, both uniform and mixed."""
    rng = random.Random(seed)
    seqs = spec["scheduler"]["max_num_seqs"]
    budget = spec["scheduler"]["max_num_batched_tokens"]
    dql = 1 + spec["speculative"]["num_speculative_tokens"]
    lora = spec["lora"]
    max_adapters = lora["max_loras"] if lora["enabled"] else 0
    top = min(budget, 1100)
    tokens = set(range(1, min(top, 64) + 1))
    for k in range(8, top + 2, 8):
        tokens |= {k - 1, k, k + 1}
    for k in range(dql, top + dql + 1, dql):
        tokens |= {k - 1, k}
    tokens |= {rng.randint(1, budget) for _ in range(40)} | {budget}
    queries = []
    for t in sorted(x for x in tokens if 1 <= x <= budget):
        reqs = {1, 2, min(t, seqs), max(1, min(t // dql, seqs)), rng.randint(1, min(t, seqs))}
        for r in sorted(x for x in reqs if x <= t):
            for q in sorted({-(-t // r), t - r + 1}):
                adapters = rng.randint(0, min(r, max_adapters + 1))
                prefill = rng.random() < 0.3
                queries.append([r, t, q, adapters, prefill])
                if 0 < adapters <= max_adapters and adapters < r:
                    # The same batch with one more adapter: what lora_slot must match
                    # when one of these requests is a base-model request instead.
                    queries.append([r, t, q, adapters + 1, prefill])
    return queries
