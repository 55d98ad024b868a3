"""The vLLM releases capplan supports, each with the planning semantics it plans with
(`target.vllm` in a spec).

Exactly the releases proven by the conformance matrix (`python -m
tests.conformance.matrix`): planning on CPU against each release's own code
with `fixes: []`, and the runtime's contract against its classes. vLLM 0.26.0
plans like 0.25 unless VLLM_USE_BREAKABLE_CUDAGRAPH is on (see below). Releases
0.27 to 0.30 plan differently from both semantics capplan models
(docs/vllm-releases.md), so they are not here.
"""

from __future__ import annotations

SUPPORTED_RELEASES = {
    "0.25.0": "0.25",
    "0.25.1": "0.25",
    "0.26.0": "0.25",
    "0.31.0": "0.33",
    "0.32.0": "0.33",
    "0.33.0": "0.33",
}


def releases_of(semantics: str) -> list[str]:
    """The supported releases that plan with these semantics."""
    return [release for release, planned in SUPPORTED_RELEASES.items() if planned == semantics]


# Releases on which VLLM_USE_BREAKABLE_CUDAGRAPH=1 (set by the user, or by vLLM itself for a
# few architectures) changes the graphs MRV2 captures: its mixed PIECEWISE graphs pad
# requests too, which neither of capplan's semantics plans. The runtime refuses the
# setting there, at start.
BREAKABLE_GRAPHS_DIFFER = ("0.26.0",)
