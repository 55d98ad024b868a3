"""Run one vLLM MRV2 engine configuration and write its outputs as JSON.

    python tests/gpu/engine_run.py MODEL_DIR OUT.json --specialize-active 1 [--eager]

Runs in its own process (one engine per process) with a fresh torch.compile
cache, so results never depend on which engine compiled first. A plan is put
in force by the capplan plugin when CAPPLAN_PLAN is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# Batches: (adapters in use, with base requests?), 8 requests each (odd ones
# base-model when base is on), so every decode step is a uniform decode batch
# of exactly k distinct adapters, plus the no-adapter slot when base is on.
BATCHES = [(k, base) for k in (1, 2, 3, 4) for base in (True, False)] + [(0, True)]
REQS_PER_BATCH = 8
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=512, max_loras=4)


def prompts_for(batch_index: int) -> list[list[int]]:
    return [[(7 * batch_index + 13 * j + t) % 2000 + 10 for t in range(5 + j)] for j in range(REQS_PER_BATCH)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--specialize-active", type=int, default=1)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--capture-sizes", default=None, help="comma-separated cudagraph_capture_sizes")
    parser.add_argument("--engine", default=None, help="JSON: scheduler limits replacing ENGINE's")
    args = parser.parse_args()
    engine = {**ENGINE, **(json.loads(args.engine) if args.engine else {})}
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from capplan.offline.smoke import assign_adapters

    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir / "base"),
        enable_lora=True,
        max_lora_rank=8,
        gpu_memory_utilization=0.3,
        attention_backend="TRITON_ATTN",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        enforce_eager=args.eager,
        specialize_active_lora=bool(args.specialize_active),
        **engine,
        **(
            {"compilation_config": {"cudagraph_capture_sizes": [int(x) for x in args.capture_sizes.split(",")]}}
            if args.capture_sizes
            else {}
        ),
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, detokenize=False)
    adapters = [LoRARequest(f"lora{i}", i, str(args.model_dir / f"lora{i}")) for i in range(1, 5)]
    results = []
    for b, (k, base) in enumerate(BATCHES):
        prompts = [{"prompt_token_ids": p} for p in prompts_for(b)]
        loras = assign_adapters(adapters, k, base, REQS_PER_BATCH)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        for j, out in enumerate(outs):
            comp = out.outputs[0]
            chosen = [max(lp.values(), key=lambda x: x.logprob).logprob if lp else None for lp in (comp.logprobs or [])]
            results.append(
                {
                    "batch": b,
                    "adapters": k,
                    "base": base,
                    "req": j,
                    "lora": None if loras[j] is None else loras[j].lora_int_id,
                    "tokens": list(comp.token_ids),
                    "logprobs": chosen,
                }
            )
    args.out.write_text(json.dumps({"startup_s": startup, "results": results}))
    print(f"engine done: startup {startup:.1f} s, {len(results)} requests")


if __name__ == "__main__":
    main()
