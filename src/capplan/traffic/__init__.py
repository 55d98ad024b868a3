"""Traffic: simulate a batch trace through a plan, the cost model, and the optimizer."""
