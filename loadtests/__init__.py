"""Workloads, benchmarks and load tests for Strata."""
