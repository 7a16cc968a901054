"""The Strata store daemon: index, tiers, movement and eviction, service and server."""
