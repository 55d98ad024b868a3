"""Analysis of plans: verify (the failure classes, over every reachable batch) and diff."""
