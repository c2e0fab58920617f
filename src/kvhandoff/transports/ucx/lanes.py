# UCX introspection: the kvhandoff ucx address envelope, the resources a context found, the
# lanes UCX chose for an endpoint, and the UCX build behind them (version, library path, whether
# it was built with verbs / rdmacm). ucxx exposes none of this except the context's info text,
# so the endpoint lanes and the version are read from libucp through ctypes.
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from kvhandoff.errors import TransportError
from kvhandoff.transports.hostid import HOST_ID_BYTES

ADDR_MAGIC = b"KVHUCX1"
# resources that cannot cross hosts or are not networks; anything else but tcp counts as RDMA
LOCAL_TLS = {"self", "sysv", "posix", "cma", "xpmem", "knem"}


def split_address(address: bytes) -> tuple[bytes, bytes]:
    """(host id, UCX worker address) of a kvhandoff ucx address."""
    head = len(ADDR_MAGIC) + HOST_ID_BYTES
    if not address.startswith(ADDR_MAGIC) or len(address) <= head:
        raise TransportError("not a kvhandoff ucx address (peer of another version?)")
    return address[len(ADDR_MAGIC):head], address[head:]


def resources(context_info: str) -> list[str]:
    """Transport/device names ('tcp/eth0', 'cma/memory', …) from ucp_context_print_info."""
    out = []
    for line in context_info.splitlines():
        if "resource" in line and "flags" in line:
            name = line.rsplit(" ", 1)[-1].strip()
            if "/" in name:
                out.append(name)
    return out


def tcp_only(lanes: tuple[str, ...]) -> bool:
    return bool(lanes) and all(lane.startswith("tcp/") for lane in lanes)


def _libucp_path() -> str | None:
    """Path of the libucp this process loaded (from /proc/self/maps), None if not loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {p for p in f.read().split() if "/libucp.so" in p}
    except OSError:
        return None
    return sorted(paths)[0] if paths else None


def ep_lanes(ep: Any) -> tuple[str, ...]:
    """Lanes UCX chose for an endpoint ('sysv/memory:am', 'cma/memory:rma_bw#0'), read from
    ucp_ep_print_info through ctypes (ucxx does not expose it). Empty if unavailable."""
    try:
        path = _libucp_path()
        if path is None:
            return ()
        ucp = ctypes.CDLL(path)
        libc = ctypes.CDLL(None)
        libc.tmpfile.restype = ctypes.c_void_p
        libc.fflush.argtypes = [ctypes.c_void_p]
        libc.rewind.argtypes = [ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.fread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                               ctypes.c_void_p]
        libc.fread.restype = ctypes.c_size_t
        ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fp = libc.tmpfile()
        if not fp:
            return ()
        try:
            ucp.ucp_ep_print_info(ctypes.c_void_p(ep.handle), fp)
            libc.fflush(fp)
            libc.rewind(fp)
            raw = ctypes.create_string_buffer(1 << 16)
            n = libc.fread(raw, 1, (1 << 16) - 1, fp)
        finally:
            libc.fclose(fp)
        text = raw.raw[:n].decode("utf-8", "replace")
    except (OSError, AttributeError, ValueError):
        return ()
    lanes = []
    for line in text.splitlines():
        if "lane[" in line and "->" in line:
            left, right = line.split("->", 1)
            tl = left.split()[2] if len(left.split()) > 2 else "?"
            tl = tl.split(":", 1)[-1].rsplit(".", 1)[0]  # '3:sysv/memory.0' -> 'sysv/memory'
            role = right.split()[-1] if right.split() else "?"
            lanes.append(f"{tl}:{role}")
    return tuple(lanes)


@dataclass(frozen=True)
class UcxBuild:
    """The UCX library this process runs on."""

    version: str  # ucp_get_version_string(), '?' if unreadable
    path: str  # the libucp.so loaded
    verbs: bool  # the build has the InfiniBand/RoCE transports (uct module 'ib')
    rdmacm: bool  # the build has the RDMA connection manager (uct module 'rdmacm')
    system: bool  # RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY asked for a system UCX

    def describe(self) -> str:
        caps = []
        caps.append("verbs" if self.verbs else "no verbs")
        caps.append("rdmacm" if self.rdmacm else "no rdmacm")
        origin = "system" if self.system and "site-packages" not in self.path else "wheel"
        return f"UCX {self.version} ({origin}, {self.path}; {', '.join(caps)})"


def ucx_build() -> UcxBuild:
    """Version, path and RDMA capability of the loaded UCX (call after ucxx is imported). The
    capability is read from the UCT modules the build ships next to libucp (ucx/libuct_ib.so,
    ucx/libuct_rdmacm.so): the libucx wheel is configured --without-verbs --without-rdmacm
    and ships neither."""
    path = _libucp_path() or "?"
    version = "?"
    if path != "?":
        try:
            ucp = ctypes.CDLL(path)
            ucp.ucp_get_version_string.restype = ctypes.c_char_p
            version = (ucp.ucp_get_version_string() or b"?").decode()
        except (OSError, AttributeError):
            pass
    moddir = os.path.join(os.path.dirname(path), "ucx")
    try:
        modules = set(os.listdir(moddir))
    except OSError:
        modules = set()
    system = os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false"
    return UcxBuild(version=version, path=path,
                    verbs=any(m.startswith("libuct_ib.so") for m in modules),
                    rdmacm=any(m.startswith("libuct_rdmacm.so") for m in modules),
                    system=system)
