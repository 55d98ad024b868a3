"""Build a tiny random Llama with peaked logits and four random LoRA adapters.

    python tests/gpu/make_model.py OUT_DIR [--moe]

Random weights (nothing is downloaded); lm_head scaled x20 so greedy tokens
are stable between graph and eager runs; peft adapters on q/k/v/o with
init_lora_weights=False, so each adapter really changes the output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _save(out: Path, model_cls, config, num_adapters: int, seed: int, meta: dict) -> None:
    """The base model with its lm_head x20, then num_adapters random peft adapters on q/k/v/o."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out / "base", safe_serialization=True)
    for i in range(1, num_adapters + 1):
        torch.manual_seed(seed + i)
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
            lora_dropout=0.0,
        )
        peft_model = get_peft_model(model_cls(config).to(torch.bfloat16), lora)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.mul_(4.0)  # big enough that dropping an adapter changes tokens
        peft_model.save_pretrained(out / f"lora{i}")
    (out / "done.json").write_text(json.dumps({"adapters": num_adapters, **meta}))


def build(out: Path, num_adapters: int = 4, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "done.json").exists():
        return
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    _save(out, LlamaForCausalLM, config, num_adapters, seed, {})


def build_moe(out: Path, num_adapters: int = 4, seed: int = 0) -> None:
    """A tiny random Mixtral (8 experts, top-2, 2 layers) for data parallel with
    expert parallelism; the same peaked lm_head and attention-only adapters."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if (out / "done.json").exists():
        return
    config = MixtralConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    _save(out, MixtralForCausalLM, config, num_adapters, seed, {"moe": True})


if __name__ == "__main__":
    (build_moe if "--moe" in sys.argv else build)(Path(sys.argv[1]))
