"""Helper processes of the cross-process memory check (``python -m kvhandoff.doctor._xproc``).

``hold``: fills a buffer with a pattern, prints ``<pid> <address> <length>`` and waits for a line
on stdin. ``read PID ADDRESS LENGTH``: reads that memory of the other process with
process_vm_readv (what UCX's cma transport does) and prints it as hex, or ``error <errno>
<message>``. The doctor starts both as siblings, so a ptrace scope that only allows
descendants is caught as it would be between two engine processes.
"""

from __future__ import annotations

import ctypes
import os
import sys

PATTERN = bytes(range(7, 7 + 64))


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _hold() -> int:
    buf = ctypes.create_string_buffer(PATTERN, len(PATTERN))
    print(os.getpid(), ctypes.addressof(buf), len(PATTERN), flush=True)
    sys.stdin.readline()
    return 0


def _read(pid: int, address: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    out = ctypes.create_string_buffer(length)
    local = _IoVec(ctypes.cast(out, ctypes.c_void_p), length)
    remote = _IoVec(ctypes.c_void_p(address), length)
    n = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n < 0:
        err = ctypes.get_errno()
        print("error", err, os.strerror(err), flush=True)
        return 0
    print(out.raw[:n].hex(), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["hold"]:
        return _hold()
    if argv[:1] == ["read"] and len(argv) == 4:
        return _read(int(argv[1]), int(argv[2]), int(argv[3]))
    print("usage: python -m kvhandoff.doctor._xproc hold | read PID ADDRESS LENGTH",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
