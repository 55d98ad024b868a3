"""Content hashes: sha256 over canonical JSON (sorted keys, no whitespace)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from capplan.schemas.spec import Spec


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def sha256(value: object) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(value).encode()).hexdigest()


def spec_data(spec: Spec) -> dict[str, Any]:
    """The spec as JSON data; a capplan-only field left at null is omitted, so plans written
    before the field existed keep their hashes (and stay loadable)."""
    data = spec.model_dump(mode="json")
    if data["cudagraph"].get("lora_case_sizes") is None:
        data["cudagraph"].pop("lora_case_sizes", None)
    for section in ("multimodal", "model", "tiers", "deployment"):
        if data.get(section, 0) is None:
            data.pop(section)
    if data.get("model"):
        data["model"] = {k: v for k, v in data["model"].items() if v is not None}
    if data["lora"].get("max_lora_rank", 0) is None:
        data["lora"].pop("max_lora_rank")
    if data["target"].get("gpu", 0) is None:
        data["target"].pop("gpu")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "moe"):
        if data["parallel"].get(name, 0) is None:
            data["parallel"].pop(name)
    return data


def spec_hash(spec: Spec) -> str:
    return sha256(spec_data(spec))


# Spec fields that cannot change which graphs exist or how they are keyed.
# Everything else is in the fingerprint, so a new field is never left out by
# accident (vLLM's hand-kept factor list dropped specialize_active_lora).
FINGERPRINT_IGNORE = {
    ("scheduler", "max_model_len"),
    ("parallel", "data_parallel_size"),
    ("parallel", "tensor_parallel_size"),
    ("parallel", "pipeline_parallel_size"),
    ("target", "gpu"),
    ("lora", "max_lora_rank"),  # the graphs' memory and kernels, not which graphs exist: a calibration compares it
}
# model: what a calibration is checked against; tiers: when each graph is captured, not which exist;
# deployment: where the settings were read from (the settings themselves are in the spec).
FINGERPRINT_IGNORE_SECTIONS = {"model", "tiers", "deployment"}


def fingerprint(spec: Spec, capture_sizes: list[int], lora_cases: list[int]) -> str:
    data = spec_data(spec)
    for section, field in FINGERPRINT_IGNORE:
        data[section].pop(field, None)
    for section in FINGERPRINT_IGNORE_SECTIONS:
        data.pop(section, None)
    data["resolved"] = {"capture_sizes": capture_sizes, "lora_capture_cases": lora_cases}
    if "prune_unreachable" in data["fixes"] and spec.parallel.synced_size > 1:
        data["resolved"]["dp_dummy_case_at_every_size"] = True  # pruning keeps it only under DP
    return sha256(data)
