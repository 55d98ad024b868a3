"""Dispatch: which captured graph serves a batch, from the plan's tables alone.

Mirrors vLLM's runner: derive the uniform-decode token count the way the
target version does, map the LoRA count to a captured case, look up the
candidates for (tokens, case) and return the first compatible one
(`_is_compatible`), else eager (cg_mode NONE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from capplan import releases
from capplan.planner.lora_cases import case_for, kernel_slots
from capplan.schemas.plan import Descriptor

if TYPE_CHECKING:
    from capplan.releases import Rules
    from capplan.schemas.plan import Plan
    from capplan.schemas.spec import Spec

# vLLM's BatchExecutionDescriptor field names, in order: the Descriptor model's fields.
DESCRIPTOR_FIELDS = tuple(Descriptor.model_fields)


class Dispatch(NamedTuple):
    """What serves a batch: vLLM's BatchExecutionDescriptor fields plus the graph id.

    A tuple, not a model: graph hits return one prebuilt per graph, and an
    eager result costs one tuple, so dispatch stays cheap on the per-step path.
    """

    cg_mode: str
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None
    max_query_len: int | None
    num_active_loras: int
    graph_id: int
    """Position of the graph in capture order; -1 when the batch runs eager."""

    def descriptor(self) -> dict[str, object]:
        """The descriptor fields alone, named as vLLM names them (public JSON)."""
        return dict(zip(DESCRIPTOR_FIELDS, self[:6]))


def _as_dispatch(desc: Descriptor, graph_id: int) -> Dispatch:
    return Dispatch(
        desc.cg_mode,
        desc.num_tokens,
        desc.num_reqs,
        desc.uniform_token_count,
        desc.max_query_len,
        desc.num_active_loras,
        graph_id,
    )


@dataclass(frozen=True)
class Batch:
    """One scheduled batch, as the runner sees it before dispatch."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    num_active_loras: int = 0
    """Distinct adapters in the batch (vLLM's num_active_loras for dispatch)."""
    base: bool = False
    """Some requests use no adapter."""
    has_prefill: bool = False
    """The batch holds a real prefill chunk (from 0.28 it keeps the batch out of decode graphs)."""
    uniform_token_count: int | None = None
    """Override; None derives it as the target vLLM's runner does."""


def derive_uniform(batch: Batch, rules: Rules) -> int | None:
    """vLLM's `get_uniform_token_count` (before 0.28), `get_uniform_decode_token_count` (0.28+,
    which gives a batch with a prefill none: `rules.prefill_breaks_uniform`)."""
    if batch.uniform_token_count is not None:
        return batch.uniform_token_count
    r, t, q = batch.num_reqs, batch.num_tokens, batch.max_query_len
    if r <= 0:
        return None
    if not rules.prefill_breaks_uniform:
        return q if q == t // r and t == q * r else None
    return q if not batch.has_prefill and t == q * r else None


def compatible(desc: Descriptor | Dispatch, num_reqs: int, uniform: int | None, max_q: int | None) -> bool:
    """Whether a graph (a Descriptor or a Dispatch) can replay a batch: vLLM's `_is_compatible`."""
    return (
        (desc.uniform_token_count is None or desc.uniform_token_count == uniform)
        and (desc.max_query_len is None or (max_q is not None and desc.max_query_len >= max_q))
        and (desc.num_reqs is None or desc.num_reqs >= num_reqs)
    )


class Dispatcher:
    """O(1) dispatch from precomputed tables.

    Per LoRA case, a list indexed by token count holds the candidates as
    (required uniform count or None, request capacity, descriptor), and a
    list indexed by LoRA count holds the case; `dispatch` is a few integer
    comparisons, no search and no function call per candidate.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.vllm = plan.spec.target.vllm
        self.rules = plan.spec.rules
        self.by_slots = plan.lora_dispatch_key == "kernel_slots"
        self.lora_map = dict(plan.lora_dispatch_map)
        self.max_case = max(self.lora_map.values(), default=0)
        # case_for (the one rule) tabulated for 0..largest case; larger counts clamp.
        self.case_of = [case_for(n, self.lora_map) for n in range(self.max_case + 1)]
        descs = plan.descriptors
        top = max((row.hi for row in plan.dispatch), default=0)
        self.max_tokens = top
        unbounded = 1 << 62
        self.table: dict[int, list[tuple[tuple[int | None, int, Dispatch], ...]]] = {}
        for row in plan.dispatch:
            column = self.table.setdefault(row.lora_case, [()] * (top + 1))
            cands = tuple(
                (descs[i].uniform_token_count, descs[i].num_reqs or unbounded, _as_dispatch(descs[i], i))
                for i in row.candidates
            )
            for n in range(row.lo, row.hi + 1):
                column[n] = cands
        # Plans from this capplan never bound max_query_len (no varlen decode
        # graphs); a plan that does takes the general path in `explain`.
        self.fast = all(d.max_query_len is None for d in descs)

    def lora_count(self, batch: Batch) -> int:
        """The count the plan dispatches LoRA by: adapters, or kernel slots under lora_slot."""
        if self.by_slots:
            return kernel_slots(batch.num_active_loras, batch.base)
        return batch.num_active_loras

    def lora_case(self, count: int) -> int:
        case_of = self.case_of
        return case_of[count] if 0 <= count < len(case_of) else case_for(count, self.lora_map)

    def dispatch(self, batch: Batch) -> Dispatch:
        if not self.fast:
            return self.explain(batch)
        uniform = derive_uniform(batch, self.rules)
        return self.lookup(batch.num_reqs, batch.num_tokens, uniform, self.lora_count(batch))

    def lookup(self, num_reqs: int, num_tokens: int, uniform: int | None, count: int) -> Dispatch:
        """Dispatch with the uniform token count already derived and `count` the
        number the plan keys LoRA by (kernel slots or adapters): the call the
        runtime makes from inside vLLM, which derives both itself."""
        case = self.lora_case(count)
        column = self.table.get(case)
        if column is not None and 0 < num_tokens <= self.max_tokens:
            for need_u, cap, desc in column[num_tokens]:
                if (need_u is None or need_u == uniform) and num_reqs <= cap:
                    return desc
        return Dispatch("NONE", num_tokens, num_reqs, None, None, case, -1)

    def explain(self, batch: Batch, trace: list[str] | None = None) -> Dispatch:
        """Dispatch, appending one human-readable reason per step to `trace`."""
        uniform = derive_uniform(batch, self.rules)
        max_q = None if (batch.has_prefill and self.rules.max_query_len_in_descriptor) else batch.max_query_len
        count = self.lora_count(batch)
        case = self.lora_case(count)
        if trace is not None:
            kind = "kernel slots" if self.by_slots else "adapters"
            trace.append(
                f"uniform_token_count={uniform} "
                f"(num_reqs={batch.num_reqs}, num_tokens={batch.num_tokens}, "
                f"max_query_len={batch.max_query_len}, vLLM {self.vllm} rule)"
            )
            trace.append(
                f"LoRA: {batch.num_active_loras} adapter(s)"
                f"{' + base requests' if batch.base else ''} -> {count} {kind} -> case {case}"
            )
        column = self.table.get(case)
        n = batch.num_tokens
        if column is not None and 0 < n <= self.max_tokens:
            for _, _, desc in column[n]:
                if compatible(desc, batch.num_reqs, uniform, max_q):
                    if trace is not None:
                        trace.append(f"replays {_short(desc)}")
                    return desc
                if trace is not None:
                    trace.append(f"skips {_short(desc)}: {_why_not(desc, batch, uniform)}")
        if trace is not None:
            if column is None:
                trace.append(f"eager: no graphs captured for LoRA case {case}")
            elif not 0 < n <= self.max_tokens:
                trace.append(f"eager: {n} tokens is above the largest graph ({self.max_tokens})")
            else:
                trace.append("eager: no compatible graph")
        return Dispatch("NONE", n, batch.num_reqs, None, None, case, -1)


def _short(desc: Dispatch) -> str:
    parts = [f"{desc.cg_mode}:{desc.num_tokens} tokens"]
    if desc.num_reqs is not None:
        parts.append(f"{desc.num_reqs} reqs")
    if desc.uniform_token_count is not None:
        parts.append(f"uniform {desc.uniform_token_count}")
    parts.append(f"LoRA case {desc.num_active_loras}")
    return ", ".join(parts)


def _why_not(desc: Dispatch, batch: Batch, uniform: int | None) -> str:
    if desc.uniform_token_count is not None and desc.uniform_token_count != uniform:
        return (
            f"needs a uniform decode batch of {desc.uniform_token_count} tokens/request "
            f"(batch: {uniform if uniform is not None else 'not uniform'})"
        )
    if desc.num_reqs is not None and desc.num_reqs < batch.num_reqs:
        return f"holds {desc.num_reqs} requests (batch: {batch.num_reqs})"
    return "max_query_len bound"


def beyond_spec(batch: Batch, spec: Spec) -> str | None:
    """Why this deployment can never schedule the batch, or None: the one rule for what a
    deployment schedules (batch files, `dispatch --reqs`, `diff`)."""
    seqs, budget = spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens
    if batch.num_reqs > seqs:
        return f"{batch.num_reqs} requests, more than max_num_seqs {seqs}"
    if batch.num_tokens > budget:
        return f"{batch.num_tokens} tokens, more than max_num_batched_tokens {budget}"
    if batch.uniform_token_count is not None and batch.has_prefill and spec.rules.prefill_breaks_uniform:
        return (
            f"uniform_token_count with has_prefill: vLLM {releases.label(spec.target.vllm)} gives a batch "
            "holding a prefill no uniform count "
            "(leave uniform_token_count out)"
        )
    if not spec.lora.enabled and batch.num_active_loras:
        return f"{batch.num_active_loras} adapter(s), but LoRA is off in this deployment"
    if spec.lora.enabled and batch.num_active_loras > spec.lora.max_loras:
        return f"{batch.num_active_loras} adapters, more than max_loras {spec.lora.max_loras}"
    return None
