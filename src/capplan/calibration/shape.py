"""A model's shape, from its config.json (Hugging Face's keys) or from the spec's `model`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from capplan.errors import InputError
from capplan.files import json_value, read_text, shown
from capplan.schemas.calibration import ModelShape
from capplan.schemas.spec import Spec

MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is a few kilobytes

# ModelShape field -> the config.json keys that give it, in order (Hugging Face's names; MoE
# models name their expert count differently).
KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "dtype": ("torch_dtype", "dtype"),
}


def shape_values(get: Callable[[str], object]) -> dict[str, object]:
    """ModelShape's fields from a config's keys (`get`: a dict's get, or getattr on vLLM's
    hf_config), the first key of each that is set; nothing checked yet."""
    values: dict[str, object] = {}
    for field, keys in KEYS.items():
        value = next((v for v in (get(k) for k in keys) if v is not None), None)
        if value is not None:
            values[field] = value
    return values


def shape_from_config(path: Path) -> ModelShape:
    """The shape a model's config.json gives (its `text_config` for a multimodal model);
    every failure is one line naming the file and the key."""
    name = shown(path)
    try:
        data = json_value(read_text(path, "model config.json", InputError, MAX_CONFIG_BYTES))
    except ValueError as exc:
        raise InputError(
            f"{name}: not a model's config.json ({exc})", "give the config.json of the model's folder"
        ) from None
    if not isinstance(data, dict):
        raise InputError(
            f"{name}: not a model's config.json (not a JSON object)", "give the model folder's config.json"
        )
    text = data.get("text_config")
    if isinstance(text, dict) and not any(k in data for k in KEYS["num_layers"]):
        data = text
    values = shape_values(data.get)
    for field in ("num_layers", "hidden_size"):
        if field not in values:
            raise InputError(
                f"{name}: gives no {KEYS[field][0]}; capture cost follows the model's layers and hidden size",
                "give the config.json of the model's folder (or its text_config's keys)",
            )
    try:
        return ModelShape.model_validate(values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0])
        key = next(k for k in KEYS[field] if data.get(k) is not None)
        raise InputError(
            f"{name}: {key} must be {'a name' if field == 'dtype' else 'a positive whole number'}, "
            f"got {str(data[key])[:60]!r}",
            "give the config.json of the model's folder",
        ) from None


def shape_from_spec(spec: Spec) -> ModelShape | None:
    """The shape the spec's `model` gives (layers and hidden size at least), or None."""
    m = spec.model
    if m is None or m.num_layers is None or m.hidden_size is None:
        return None
    return ModelShape(num_layers=m.num_layers, hidden_size=m.hidden_size, dtype=m.dtype)
