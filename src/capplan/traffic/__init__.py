"""Traffic: simulate a batch trace through a plan, step times, and the optimizer."""
