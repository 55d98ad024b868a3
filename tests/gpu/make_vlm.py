"""Build a tiny random Qwen2-VL with two LoRA adapters that reach into its vision tower.

    python tests/gpu/make_vlm.py OUT_DIR [--check]

Nothing is downloaded. OUT_DIR/base is a Qwen2VLForConditionalGeneration
(2 text layers, hidden 256, M-RoPE; a 2-block vision tower of width 128 and
its patch merger) in bf16 with lm_head x20 (stable greedy tokens), a
byte-level BPE tokenizer with Qwen2-VL's special tokens, and a Qwen2-VL
image processor config (14 px patches, merge 2, 4 to 16 image tokens per
image). The files are written the way Qwen2-VL checkpoints ship them, so any
transformers 5 release reads them. Adapters (peft, init_lora_weights=False,
then normal(0, 0.1), big enough that each changes the output):
- lora1: vision blocks (attn.qkv, attn.proj, mlp.fc1, mlp.fc2), the merger
  (mlp.0, mlp.2) and the language model's q/k/v/o;
- lora2: vision blocks and merger only: whatever it changes, it changes
  through the tower and connector, so with tower LoRA ignored its outputs
  equal the base model's.
--check loads the processor, the model and each adapter with transformers
and peft, runs one image prompt and prints what changed (CPU is enough).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB = 320  # 256 byte tokens, the special tokens, room for generated ids
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # 4 to 16 image tokens
TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
HEAD_DIM = TEXT["hidden_size"] // TEXT["num_attention_heads"]
MROPE_SECTION = [8, 12, 12]  # temporal, height, width: sums to HEAD_DIM / 2, as vLLM's MRotaryEmbedding asserts
VISION = dict(depth=2, embed_dim=128, num_heads=2, mlp_ratio=2)
# Module patterns peft matches with re.fullmatch. Full paths, so the patch embedding's
# Conv3d (also named "proj") is never targeted; vLLM wraps only the linear layers.
TOWER = r".*visual\.blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)"
CONNECTOR = r".*visual\.merger\.mlp\.(0|2)"
LANGUAGE = r".*language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
ADAPTERS = {"lora1": [TOWER, CONNECTOR, LANGUAGE], "lora2": [TOWER, CONNECTOR]}
LORA_STD = 0.1


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (the alphabet of byte-level BPE), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def token_ids() -> dict[str, int]:
    return {tok: 256 + i for i, tok in enumerate(SPECIAL)}


def _write_tokenizer(base: Path) -> None:
    """A byte-level BPE with no merges (one token per byte) plus Qwen2-VL's special tokens,
    saved as tokenizer.json, vocab.json, merges.txt and tokenizer_config.json like Qwen2-VL's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(base / "tokenizer.json"))
    (base / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (base / "merges.txt").write_text("#version: 0.2\n")
    ids = token_ids()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL
        },
    }
    (base / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_image_processor(base: Path) -> None:
    """Qwen2-VL's preprocessor_config.json, shrunk: the format every transformers release reads."""
    config = {
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    (base / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def _config():
    from transformers import Qwen2VLConfig

    ids = token_ids()
    text = dict(
        TEXT,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    vision = dict(
        VISION,
        hidden_size=TEXT["hidden_size"],  # the merger's output width: the text model's
        in_channels=3,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        hidden_act="quick_gelu",
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build(out: Path, seed: int = 0) -> dict:
    """Write OUT/base, OUT/lora1, OUT/lora2 and OUT/done.json (returned); a no-op once done."""
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    base = out / "base"
    base.mkdir(parents=True, exist_ok=True)
    config = _config()
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(base, safe_serialization=True)
    _write_tokenizer(base)
    _write_image_processor(base)
    saved = {}
    for i, (name, patterns) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed + i)
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules="|".join(f"(?:{p})" for p in patterns),
            init_lora_weights=False,
            lora_dropout=0.0,
        )
        peft_model = get_peft_model(Qwen2VLForConditionalGeneration(config).to(torch.bfloat16), lora)
        targets = []
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.normal_(0.0, LORA_STD)
                    if ".lora_A." in pname:
                        targets.append(pname.split(".lora_A.")[0])
        peft_model.save_pretrained(out / name)
        saved[name] = {"modules": len(targets), "example": sorted(targets)[:2]}
    meta = {"adapters": saved, "token_ids": token_ids(), "vocab": VOCAB, "seed": seed}
    done.write_text(json.dumps(meta, indent=2))
    return meta


def prompt(with_image: bool) -> str:
    """A Qwen2-VL chat prompt written out (no chat template needed)."""
    image = "<|vision_start|><|image_pad|><|vision_end|>" if with_image else ""
    return f"<|im_start|>user\n{image}What is in this picture?<|im_end|>\n<|im_start|>assistant\n"


def make_image(index: int):
    """A random RGB picture, fixed by its index; four sizes (16, 12, 8 and 4 image tokens)."""
    import numpy as np
    from PIL import Image

    sizes = [(112, 112), (112, 84), (56, 112), (56, 56)]  # (width, height), multiples of 28
    width, height = sizes[index % len(sizes)]
    rng = np.random.default_rng(1000 + index)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))  # HxWx3 uint8: RGB


def check(out: Path) -> dict:
    """transformers + peft on what build() wrote: processor, base forward, each adapter's change."""
    import torch
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    base = out / "base"
    processor = AutoProcessor.from_pretrained(base)
    inputs = processor(text=[prompt(True)], images=[make_image(0)], return_tensors="pt")
    image_id = token_ids()["<|image_pad|>"]
    result = {
        "processor": type(processor).__name__,
        "image_processor": type(processor.image_processor).__name__,
        "tokenizer": type(processor.tokenizer).__name__,
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "image_tokens": int((inputs["input_ids"] == image_id).sum()),
        "image_grid_thw": inputs["image_grid_thw"].tolist(),
        "pixel_values": list(inputs["pixel_values"].shape),
    }
    model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = model(**inputs).logits[0, -1].float()
    result["base_next_token"] = int(ref.argmax())
    for name in ADAPTERS:
        lora_model = PeftModel.from_pretrained(
            Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.bfloat16), out / name
        ).eval()
        with torch.no_grad():
            logits = lora_model(**inputs).logits[0, -1].float()
            # The same adapter without the image: lora2 (tower and connector only) must then do nothing.
            text_only = processor(text=[prompt(False)], return_tensors="pt")
            no_image = lora_model(**text_only).logits[0, -1].float()
            no_image_base = model(**text_only).logits[0, -1].float()
        result[name] = {
            "next_token": int(logits.argmax()),
            "max_logit_change_with_image": round(float((logits - ref).abs().max()), 4),
            "max_logit_change_text_only": round(float((no_image - no_image_base).abs().max()), 4),
        }
    return result


def greedy(out: Path, requests: list[tuple[int | None, str | None]], max_tokens: int, device: str) -> list[dict]:
    """transformers' own greedy tokens for (image index or None, adapter or None) requests: a
    full forward per step (no KV cache, so nothing but the model decides), top-2 logprobs kept."""
    import torch
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(out / "base")
    models: dict = {}

    def model_for(name: str | None):
        if name not in models:
            model = Qwen2VLForConditionalGeneration.from_pretrained(out / "base", dtype=torch.bfloat16)
            if name is not None:
                model = PeftModel.from_pretrained(model, out / name)
            models[name] = model.to(device).eval()
        return models[name]

    results = []
    for image, lora in requests:
        extra = {"images": [make_image(image)]} if image is not None else {}
        inputs = processor(text=[prompt(image is not None)], return_tensors="pt", **extra).to(device)
        ids = inputs["input_ids"]
        # Per-token side inputs (attention_mask, and mm_token_type_ids in newer releases) grow with the ids.
        per_token = {k: v for k, v in inputs.items() if k != "input_ids" and getattr(v, "shape", None) == ids.shape}
        model = model_for(lora)
        tokens, top = [], []
        with torch.no_grad():
            for _ in range(max_tokens):
                for module in model.modules():  # Qwen2-VL caches its M-RoPE offsets between calls
                    if hasattr(module, "rope_deltas"):
                        module.rope_deltas = None
                feed = {**inputs, **per_token, "input_ids": ids}
                logprobs = torch.log_softmax(model(**feed, use_cache=False).logits[0, -1].float(), dim=-1)
                values, index = logprobs.topk(2)
                tokens.append(int(index[0]))
                top.append([[int(i), round(float(v), 5)] for i, v in zip(index, values)])
                ids = torch.cat([ids, index[:1].view(1, 1)], dim=1)
                for key, value in per_token.items():
                    fill = torch.ones_like(value[:, :1]) if key == "attention_mask" else torch.zeros_like(value[:, :1])
                    per_token[key] = torch.cat([value, fill], dim=1)
        results.append(
            {
                "image": image,
                "lora": lora,
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "tokens": tokens,
                "top": top,
            }
        )
    return results


if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(json.dumps(build(target), indent=2))
    if "--check" in sys.argv:
        print(json.dumps(check(target), indent=2))
