"""A deliberate deferred-capture error, for the token comparison's positive control (GPU runs only).

Python imports this module at start-up when its folder is on PYTHONPATH; it does nothing unless
CAPPLAN_FAULT=fallback-one-slot-short. Then every batch whose graph is not captured yet, and that
deferred capture sends to a fallback graph, replays instead a captured graph of the same mode, the
next smaller LoRA case (one adapter slot too few: its LoRA kernels' grid was frozen for fewer
adapters) and enough tokens and requests. That is the failure deferred capture must never have; a
comparison that does not see it cannot vouch for the real runs. The engine log gets
"capplan-fault: installed" so a result shows the fault was in force.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("CAPPLAN_FAULT") == "fallback-one-slot-short":
    try:
        from capplan.runtime.deferred import graphs as _graphs
    except Exception as exc:  # noqa: BLE001 - said in the log, the control then shows no fault
        print(f"capplan-fault: not installed ({type(exc).__name__}: {exc})", file=sys.stderr)
    else:
        _original = _graphs.GraphSets.resolve

        def _one_slot_short(self, graph_id: int) -> int:  # type: ignore[no-untyped-def]
            got = _original(self, graph_id)
            if got < 0 or got == graph_id:
                return got
            graphs = [g.descriptor for g in self.graphs]
            want = graphs[graph_id]
            fell = graphs[got]
            cases = sorted({g.num_active_loras for g in graphs})
            smaller = [c for c in cases if c < fell.num_active_loras]
            if not smaller:
                return got
            case = smaller[-1]
            fits = [
                gid
                for gid in self.captured
                if (g := graphs[gid]).cg_mode == fell.cg_mode
                and g.num_active_loras == case
                and g.num_tokens >= want.num_tokens
                and (g.num_reqs is None or (want.num_reqs is not None and g.num_reqs >= want.num_reqs))
                and g.uniform_token_count == fell.uniform_token_count
            ]
            if not fits:
                return got
            self.fault_swaps = getattr(self, "fault_swaps", 0) + 1
            return min(fits, key=lambda gid: graphs[gid].num_tokens)

        _graphs.GraphSets.resolve = _one_slot_short  # type: ignore[method-assign]
        print("capplan-fault: installed", file=sys.stderr)
