"""A deliberate deferred-capture error, for the token comparison's positive control (GPU runs only).

Python imports this module at start-up when its folder is on PYTHONPATH; it does nothing unless
CAPPLAN_FAULT=fallback-one-slot-short. Then every batch whose graph is not captured yet, and that
deferred capture sends to a fallback graph, replays instead a captured graph of the same mode, the
next smaller LoRA case (one adapter slot too few: its LoRA kernels' grid was frozen for fewer
adapters) and enough tokens and requests (`one_slot_short.py`). That is the failure deferred
capture must never have; a comparison that does not see it cannot vouch for the real runs. The
engine log gets "capplan-fault: installed" so a result shows the fault was in force, and
"capplan-fault: swap N" for the first 20 swaps and every 100th, so it shows how often it bit.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("CAPPLAN_FAULT") == "fallback-one-slot-short":
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when run by path
        from one_slot_short import one_slot_short

        from capplan.runtime.deferred import graphs as _graphs
    except Exception as exc:  # noqa: BLE001 - said in the log, the control then shows no fault
        print(f"capplan-fault: not installed ({type(exc).__name__}: {exc})", file=sys.stderr)
    else:
        _original = _graphs.GraphSets.resolve

        def _resolve(self, graph_id: int, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
            got = _original(self, graph_id, *args, **kwargs)
            new = one_slot_short(self.graphs, self.captured, graph_id, got)
            if new != got:
                self.fault_swaps = n = getattr(self, "fault_swaps", 0) + 1
                if n <= 20 or n % 100 == 0:  # the log shows the fault bit, and how often
                    print(f"capplan-fault: swap {n}: graph {got} -> {new} for {graph_id}", file=sys.stderr, flush=True)
            return new

        _graphs.GraphSets.resolve = _resolve  # type: ignore[method-assign]
        print("capplan-fault: installed", file=sys.stderr)
