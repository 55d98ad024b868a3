"""Deferred capture (spec tiers): the ready graphs before the engine reports ready, the
deferred ones while it serves. `capture` holds the per-process state and the captures;
`hooks` registers its entries in the runtime's registry."""
