"""How large the serve-first run's random adapters may be for its token comparison to have power,
on a CPU (torch and transformers, about 17 GB of memory, a few minutes on 2 cores):

    NOISE_EXP=8 python tests/gpu/adapter_noise.py tests/gpu/configs/llama-3.1-8b.json 1 0.75 1.5 4

Llama-3.1-8B's shape with random bf16 weights (the library's initialisation) and one random
rank-16 adapter on q/k/v/o (kaiming-uniform A and B as peft's random initialisation draws them,
lora_alpha 2r, then A and B each multiplied by the scale given). For 16 prompts, the first
generated step's top-5 logprobs are compared by production_serve.distance's rule (the largest
difference of a token's logprob in both lists; None where a top token is outside the other's
top-5):
- noise: the same model twice, once with every decoder layer's output multiplied by
  (1 + N(0, 2**-NOISE_EXP)), the size of bfloat16's rounding: what another kernel or batch does;
- effect: the model with the adapter against the model without it: what a graph of one adapter
  slot too few does to that adapter's request (the fault control).
The comparison has power where the noise stays well below the rule's 0.5 nats and the effect
well above it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    usage = "usage: [NOISE_EXP=8] adapter_noise.py CONFIG.json SCALE [SCALE ...] (scales: positive numbers)"
    try:
        cfg = json.loads(open(sys.argv[1]).read())
        scales = [float(x) for x in sys.argv[2:]]
        noise = 2.0 ** -int(os.environ.get("NOISE_EXP", "8"))
    except (IndexError, OSError, ValueError) as exc:
        raise SystemExit(f"{usage}: {exc}") from None
    if not scales or any(not x > 0 for x in scales):
        raise SystemExit(usage)
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    print(f"built in {time.time() - t0:.0f} s; noise 2**-{os.environ.get('NOISE_EXP', '8')}", flush=True)

    def kaiming(shape: tuple[int, int]) -> torch.Tensor:
        w = torch.empty(shape, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w

    torch.manual_seed(101)
    state = {"scale": 0.0, "noise": 0.0}
    gen = torch.Generator().manual_seed(7)

    def adapter(a: torch.Tensor, b: torch.Tensor):  # type: ignore[no-untyped-def]
        def hook(mod, inp, out):  # type: ignore[no-untyped-def]
            s = state["scale"]
            if not s:
                return out
            return out + (2.0 * (inp[0].float() @ (a * s).T) @ (b * s).T).to(out.dtype)

        return hook

    def perturb(mod, inp, out):  # type: ignore[no-untyped-def]
        if not state["noise"]:
            return out
        h = out[0] if isinstance(out, tuple) else out
        h2 = (h.float() * (1 + torch.randn(h.shape, generator=gen) * state["noise"])).to(h.dtype)
        return (h2, *out[1:]) if isinstance(out, tuple) else h2

    for layer in model.model.layers:
        for name in PROJECTIONS:
            lin = getattr(layer.self_attn, name)
            lin.register_forward_hook(adapter(kaiming((RANK, lin.in_features)), kaiming((lin.out_features, RANK))))
        layer.register_forward_hook(perturb)
    prompts = torch.tensor(  # 16 prompts of 12 tokens, drawn as production_serve.prompt draws them
        [[(7919 * g + 104729 * i + 31 * t) % 30000 + 10 for t in range(12)] for g in range(8) for i in (0, 5)]
    )

    def top(scale: float, with_noise: bool) -> list[dict[int, float]]:
        state["scale"], state["noise"] = scale, noise if with_noise else 0.0
        with torch.no_grad():
            lp = torch.log_softmax(model(prompts).logits[:, -1].float(), -1)
        v, i = lp.topk(5)
        return [dict(zip(ii.tolist(), vv.tolist())) for vv, ii in zip(v, i)]

    def distance(a: dict[int, float], b: dict[int, float]) -> float | None:
        if max(a, key=a.get) not in b or max(b, key=b.get) not in a:  # type: ignore[arg-type]
            return None
        return round(max(abs(a[t] - b[t]) for t in a if t in b), 3)

    def row(a: list, b: list) -> list:
        return [distance(x, y) for x, y in zip(a, b)]

    base = top(0.0, False)

    def said(values: list) -> str:
        known = sorted(v for v in values if v is not None)
        worst = f", largest {known[-1]}" if known else ""
        return f"{values} ({sum(v is None for v in values)} no match{worst})"

    print(f"no adapter: noise {said(row(base, top(0.0, True)))}", flush=True)
    for s in scales:
        clean = top(s, False)
        print(f"scale {s}: noise {said(row(clean, top(s, True)))}", flush=True)
        print(f"scale {s}: effect (adapter left out) {said(row(clean, base))}", flush=True)


if __name__ == "__main__":
    main()
