# Which host a transport runs on: peers with the same id share memory (same boot, same host
# name), so same-host lanes (shared memory, cross-memory writes) can reach them.
from __future__ import annotations

import functools
import hashlib
import socket

HOST_ID_BYTES = 16


@functools.cache
def host_id() -> bytes:
    """16 bytes identifying this host (boot id + host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return hashlib.sha256(boot + b"/" + socket.gethostname().encode()).digest()[:HOST_ID_BYTES]
