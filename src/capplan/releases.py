"""The vLLM releases capplan supports, each with the planning semantics it plans with
(`target.vllm` in a spec).

Exactly the releases proven by the conformance matrix (`python -m
tests.conformance.matrix`): planning on CPU against each release's own code
with `fixes: []`, and the runtime's contract against its classes. Releases
0.26 to 0.30 plan differently from both semantics capplan models
(docs/vllm-releases.md), so they are not here.
"""

from __future__ import annotations

SUPPORTED_RELEASES = {
    "0.25.0": "0.25",
    "0.25.1": "0.25",
    "0.31.0": "0.33",
    "0.32.0": "0.33",
    "0.33.0": "0.33",
}


def releases_of(semantics: str) -> list[str]:
    """The supported releases that plan with these semantics."""
    return [release for release, planned in SUPPORTED_RELEASES.items() if planned == semantics]
