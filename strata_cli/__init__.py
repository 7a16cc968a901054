"""The `strata` command: one entry point for the daemon, engines, benchmarks and load tests."""
