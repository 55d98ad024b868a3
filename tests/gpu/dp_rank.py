"""One data-parallel rank of the DP=2 MoE + LoRA run (started by dp_launch.py).

    python tests/gpu/dp_rank.py MODEL_DIR OUT.json --specialize-active 1

Both ranks call generate() the same number of times (vLLM's offline DP keeps
ranks in lockstep; a rank that runs out of work runs dummy batches), but serve
different traffic: rank 0 serves k adapters plus base requests, 8 at a time;
rank 1 serves base-only batches, other adapter counts and fewer, shorter
requests, so the ranks' token counts differ and one pads to the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# Per round: (adapters, base requests?, number of requests, max_tokens) for rank 0 and rank 1.
ROUNDS = [
    ((1, True, 8, 16), (0, True, 3, 8)),
    ((2, True, 8, 16), (2, False, 5, 12)),
    ((3, True, 8, 16), (0, True, 1, 4)),
    ((4, True, 8, 16), (4, False, 6, 10)),
    ((2, False, 8, 16), (1, True, 7, 16)),
    ((4, True, 8, 12), (3, True, 4, 16)),
]


def prompts_for(rank: int, rnd: int, n: int) -> list[list[int]]:
    return [[(31 * rank + 7 * rnd + 13 * j + t) % 2000 + 10 for t in range(3 + 2 * j + rank)] for j in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--specialize-active", type=int, default=1)
    args = parser.parse_args()
    rank = int(os.environ["VLLM_DP_RANK"])
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix=f"vllm-cache-r{rank}-"))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from capplan.offline.smoke import assign_adapters

    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir / "base"),
        enable_lora=True,
        max_lora_rank=8,
        max_loras=4,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        attention_backend="TRITON_ATTN",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        enable_expert_parallel=True,
        specialize_active_lora=bool(args.specialize_active),
    )
    startup = time.perf_counter() - t0
    adapters = [LoRARequest(f"lora{i}", i, str(args.model_dir / f"lora{i}")) for i in range(1, 5)]
    results = []
    for rnd, pair in enumerate(ROUNDS):
        k, base, n, max_tokens = pair[rank]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, detokenize=False)
        loras = assign_adapters(adapters, k, base, n)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts_for(rank, rnd, n)], params, lora_request=loras, use_tqdm=False
        )
        for j, out in enumerate(outs):
            comp = out.outputs[0]
            chosen = [max(lp.values(), key=lambda x: x.logprob).logprob if lp else None for lp in (comp.logprobs or [])]
            results.append(
                {
                    "round": rnd,
                    "req": j,
                    "adapters": k,
                    "base": base,
                    "lora": None if loras[j] is None else loras[j].lora_int_id,
                    "tokens": list(comp.token_ids),
                    "logprobs": chosen,
                }
            )
    args.out.write_text(json.dumps({"rank": rank, "startup_s": startup, "results": results}))
    print(f"rank {rank} done: startup {startup:.1f} s, {len(results)} requests", flush=True)
    # Shut the engine down so that its worker process (vLLM uses one per rank
    # under DP) exits normally and writes capplan's report; then skip the
    # interpreter's DP teardown, as both ranks have written everything.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        print(f"rank {rank}: engine shutdown failed: {exc!r}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
