"""Which host (and boot) this process runs on, so a client can tell that a daemon is local.

Two processes share a host id only if they see the same kernel boot and the same /dev/shm, which
is exactly when the daemon's shared-memory segment can be mapped.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

import xxhash


@lru_cache(maxsize=1)
def host_id() -> str:
    """A stable id of this host for this boot: hostname, kernel boot id and /dev/shm's device."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        shm_dev = str(os.stat("/dev/shm").st_dev)
    except OSError:
        shm_dev = "no-shm"
    raw = f"{socket.gethostname()}|{boot}|{shm_dev}"
    return xxhash.xxh3_64_hexdigest(raw.encode())
