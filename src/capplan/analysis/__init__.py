"""Analysis of plans: verify (docs/design.md's failure classes, over every reachable batch) and diff."""
