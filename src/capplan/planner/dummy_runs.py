"""Dummy batches vLLM runs outside graph capture, and their longest request.

MRV2's `_dummy_run` builds a batch of `num_tokens` over
min(num_tokens, max_num_seqs) requests (vLLM: `GPUModelRunner._dummy_run`,
then `InputBatch.make_dummy` for the inputs). It runs:

- `profile`: the memory-profiling pass and the compile warm-up of the
  largest compile range, both with num_tokens = max_num_batched_tokens (the
  warm-up runs attention, so every dummy request's length is read against
  the block table, sized for max_model_len);
- `dp_idle` (data parallel > 1): a rank with no work runs a one-request
  dummy batch of decode_query_len tokens, then pads it to the token count the
  ranks agreed on. On a PIECEWISE graph (no request padding) that is one
  request of up to the largest mixed graph's size.

vLLM before 0.27 puts the whole remainder of num_tokens / requests on the last
request; 0.27+ and capplan's `dummy_remainder` fix spread it one token each
over the last requests. The DP idle batch has one request, so no fix of the
remainder shortens it: verify reports it when it exceeds max_model_len.
"""

from __future__ import annotations

from capplan.planner.dummy_layout import token_runs
from capplan.schemas.plan import DummyRun
from capplan.schemas.spec import Fix, Spec


def dummy_runs(spec: Spec, mixed_graph_tokens: list[int]) -> list[DummyRun]:
    """The dummy runs of this spec: vLLM's layout and the plan's (under its fixes).

    `mixed_graph_tokens`: token counts of the plan's graphs that pad no
    requests (PIECEWISE), which a DP idle rank can be padded to."""
    tokens = spec.scheduler.max_num_batched_tokens
    reqs = min(tokens, spec.scheduler.max_num_seqs)
    vllm_spreads = spec.rules.spreads_dummy_remainder
    runs = [
        DummyRun.trusted(
            run="profile",
            tokens=tokens,
            vllm=token_runs(tokens, reqs, vllm_spreads),
            plan=token_runs(tokens, reqs, vllm_spreads or spec.has(Fix.dummy_remainder)),
        )
    ]
    if spec.parallel.synced_size > 1 and mixed_graph_tokens:
        top = max(mixed_graph_tokens)
        runs.append(DummyRun.trusted(run="dp_idle", tokens=top, vllm=[(1, top)], plan=[(1, top)]))
    return runs
