"""`python -m loadtests.peers.mooncake_holder MASTER SEGMENT_BYTES`: mount Mooncake storage and
hold it for the remote rows of `strata bench store --against mooncake`.

Prints `ready` on its first stdout line once the storage is mounted, then waits until its
standard input closes, unmounts and exits (0; 1 if the setup failed).
"""

from __future__ import annotations

import sys

from loadtests.peers.mooncake import PeerFailed, open_store


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m loadtests.peers.mooncake_holder MASTER SEGMENT_BYTES", file=sys.stderr)
        return 2
    try:
        store = open_store(argv[0], int(argv[1]))
    except PeerFailed as exc:
        print(f"failed: {exc}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the benchmark closes our input (or exits)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
