"""Whether this machine has an IPv6 loopback (``::1``), and the mark that skips without one.

The answer is what binding ``[::1]`` does (a container may list ``::1`` on ``lo`` and still
refuse it, or have IPv6 disabled by sysctl); the reason quotes ``ip -6 addr show lo`` where
``ip`` is installed, so a skip says what the machine has.
"""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess

import pytest


@functools.cache
def no_ipv6_loopback() -> str | None:
    """None where ``[::1]`` can be bound, else why not."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError as e:
        seen = ""
        if shutil.which("ip"):
            out = subprocess.run(["ip", "-6", "addr", "show", "lo"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
            seen = f"; `ip -6 addr show lo`: {out or '(nothing)'}"
        return f"no IPv6 loopback on this machine (binding [::1] failed: {e}){seen}"
    return None


needs_ipv6_loopback = pytest.mark.skipif(no_ipv6_loopback() is not None,
                                         reason=str(no_ipv6_loopback()))
