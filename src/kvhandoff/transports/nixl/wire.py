# What the nixl transport puts on the wire (no pickle: msgpack through msgspec, versioned) and
# the pure helpers of a write: which memory a registered buffer is, and the descriptor lists
# of a write (one descriptor per piece of its span plan, vectorised).
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan

VERSION = 1


class NixlAddress(msgspec.Struct, frozen=True, tag="kvh-nixl-address"):
    """A nixl transport's address: its TCP address (two-sided ops) and its NIXL agent."""

    v: int
    tcp: bytes
    agent: str
    metadata: bytes  # the NIXL agent metadata (get_agent_metadata)


class NixlRegion(msgspec.Struct, frozen=True, tag="kvh-nixl-region"):
    """describe(name): a buffer registered with the agent `agent`."""

    v: int
    agent: str
    mem: str  # "DRAM" or "VRAM"
    addr: int
    length: int
    device: int
    metadata: bytes  # the agent's partial metadata of this region (its remote keys)


_ENC = msgspec.msgpack.Encoder()
_ADDR = msgspec.msgpack.Decoder(NixlAddress)
_REGION = msgspec.msgpack.Decoder(NixlRegion)


def encode(obj: NixlAddress | NixlRegion) -> bytes:
    return _ENC.encode(obj)


def decode_address(raw: bytes) -> NixlAddress:
    try:
        addr = _ADDR.decode(raw)
    except (msgspec.DecodeError, TypeError) as e:
        raise TransportError(f"nixl: address {bytes(raw)[:40]!r}... is not a nixl transport "
                             f"address ({e}); both agents must use the same transport") from None
    if addr.v != VERSION:
        raise TransportError(f"nixl: address version {addr.v} is not supported (this side "
                             f"speaks {VERSION}); upgrade both agents alike")
    return addr


def decode_region(raw: bytes) -> NixlRegion:
    try:
        region = _REGION.decode(raw)
    except (msgspec.DecodeError, TypeError) as e:
        raise TransportError(f"register_remote: descriptor is not a nixl buffer descriptor "
                             f"({e})") from None
    if region.v != VERSION:
        raise TransportError(f"register_remote: descriptor version {region.v} is not "
                             f"supported (this side speaks {VERSION})")
    if region.mem not in ("DRAM", "VRAM") or region.length < 0 or region.addr <= 0:
        raise TransportError(f"register_remote: descriptor field mem/addr/length invalid: "
                             f"{region.mem!r} {region.addr:#x} {region.length}")
    return region


@dataclass(frozen=True)
class Memory:
    """A registered buffer as NIXL sees it; `host` is the numpy array of a DRAM buffer."""

    mem: str
    addr: int
    length: int
    device: int
    host: np.ndarray | None


def memory_of(name: str, buf: Any) -> Memory:
    """DRAM for a 1-D uint8 numpy array; VRAM for a contiguous CUDA tensor/array (anything
    with __cuda_array_interface__), its bytes and device id. TransportError otherwise."""
    if isinstance(buf, np.ndarray):
        return Memory("DRAM", int(buf.ctypes.data), int(buf.nbytes), 0, buf)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        raise TransportError(f"register {name!r}: buf must be a numpy.ndarray (DRAM) or a CUDA "
                             f"tensor (VRAM), got {type(buf).__name__}")
    strides = cai.get("strides")
    if strides is not None:
        itemsize = np.dtype(cai["typestr"]).itemsize
        expect = itemsize
        for dim, stride in zip(reversed(cai["shape"]), reversed(strides), strict=True):
            if dim > 1 and stride != expect:
                raise TransportError(f"register {name!r}: the CUDA buffer must be contiguous")
            expect *= dim
    nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize
    device = _cuda_device(buf)
    return Memory("VRAM", int(cai["data"][0]), nbytes, device, None)


def _cuda_device(buf: Any) -> int:
    dev = getattr(buf, "device", None)
    index = getattr(dev, "index", None)  # torch.device
    if isinstance(index, int):
        return index
    dev_id = getattr(dev, "id", None)  # cupy.cuda.Device
    return int(dev_id) if isinstance(dev_id, int) else 0


def write_descs(local: Memory, plan: SpanPlan, remote: NixlRegion
                ) -> tuple[np.ndarray, np.ndarray]:
    """(local N x 3, remote N x 3) descriptor arrays (address, length, device) of a write:
    descriptor i is piece i of the span plan (checked against both buffers)."""
    so, do, lens = plan.src_offsets, plan.dst_offsets, plan.nbytes
    n = lens.size
    ldesc = np.empty((n, 3), np.int64)
    rdesc = np.empty((n, 3), np.int64)
    ldesc[:, 0] = so + local.addr
    ldesc[:, 1] = lens
    ldesc[:, 2] = local.device
    rdesc[:, 0] = do + remote.addr
    rdesc[:, 1] = lens
    rdesc[:, 2] = remote.device
    return ldesc, rdesc
