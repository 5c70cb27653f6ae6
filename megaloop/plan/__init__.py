"""Plan: ops -> tile tasks -> static per-processor queues with dependency counters, buffer offsets
from tensor lifetimes, a versioned JSON format and a verifier (races, deadlocks).

Not built yet: this is the second issue of the first tranche. The op definitions it will read
(``megaloop.frontend.opdef.REGISTRY``) and the rank matching it will extend
(``megaloop.parallel.match_ranks``) are in place."""
