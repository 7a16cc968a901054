"""`strata chaos`: a store load from several client processes while faults are injected in turn,
with every acknowledged page checked byte for byte and the daemon checked for leaks
(`cli` runs it, `phase` is one fault's run and checks, `faults` the faults, `worker` one client
process, `pages` the key-derived payloads, `report` the summary)."""
