"""The client's contract with the store: scopes and page keys, the page codec, the value types
and the typed errors. Pure: no I/O, no transport, nothing of the cluster (an import-linter
contract in pyproject.toml holds the layers apart)."""
