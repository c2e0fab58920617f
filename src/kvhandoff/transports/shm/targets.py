# The targets of the shm transport's one-sided writes: installing a peer's buffer descriptor
# as a write target (host memory: a mapped kvhandoff segment or process_vm_writev; CUDA memory:
# the peer's IPC block, opened once), after checking the peer's process vouched for it.
#
# Rules: plain functions over what the caller passes (no transport state): the transport looks
# the peer up under its lock, calls `open_remote` outside it, and installs the result.
from __future__ import annotations

from kvhandoff.errors import TransportError
from kvhandoff.transports.shm.copy import Target, open_target
from kvhandoff.transports.shm.cuda import (
    DeviceLane,
    DeviceTarget,
    is_device_descriptor,
    parse_device_descriptor,
)
from kvhandoff.transports.shm.wire import ShmPeer, parse_descriptor


def descriptor_pid(descriptor: bytes) -> int:
    """The process a buffer descriptor (host or CUDA) is of; raises if it is none."""
    if is_device_descriptor(descriptor):
        return parse_device_descriptor(descriptor)[0]
    return parse_descriptor(descriptor)[0]


def open_remote(info: ShmPeer, name: str, descriptor: bytes, *, local_device: bool | None,
                allow_map: bool, dev_lane: DeviceLane) -> Target | DeviceTarget:
    """Opens peer `info`'s buffer `descriptor` as the target of writes under `name`.

    Args:
        local_device: whether this side's buffers are CUDA memory (None: none registered).
        allow_map: whether a host target may be mapped (else process_vm_writev).

    Raises:
        TransportError: the descriptor is of another process, not one of the buffers the
            peer's process vouched for over its socket (host memory), of the other memory
            kind than this side's buffers, or cannot be opened.
    """
    pid = descriptor_pid(descriptor)
    if pid != info.pid:
        raise TransportError(f"register_remote {name!r}: the descriptor is of process {pid}, "
                             f"peer {info.name!r} is process {info.pid}")
    device = is_device_descriptor(descriptor)
    if not device:
        check_vouched(info, descriptor, f"register_remote {name!r}")
    if local_device is not None and local_device != device:
        kinds = ("CUDA", "host") if device else ("host", "CUDA")
        raise TransportError(f"register_remote {name!r}: peer {info.name!r}'s buffer is "
                             f"{kinds[0]} memory and this side's buffers are {kinds[1]} memory; "
                             "shm writes host to host or device to device, not across")
    if not device:
        return open_host(info, descriptor, allow_map)
    if local_device is None:
        raise TransportError(f"register_remote {name!r}: peer {info.name!r}'s buffer is CUDA "
                             "memory and this side has no buffer registered; shm writes host "
                             "to host or device to device, not across")
    _, n, export = parse_device_descriptor(descriptor)
    try:
        tensor = dev_lane.open(info.name, export)
    except Exception as e:  # noqa: BLE001 - a CUDA or torch error opening the handle
        raise TransportError(f"register_remote {name!r}: opening peer {info.name!r}'s CUDA IPC "
                             f"handle failed: {e}") from e
    return DeviceTarget(pid, n, tensor)


def check_vouched(info: ShmPeer, descriptor: bytes, what: str) -> None:
    """Refuses a host buffer descriptor the peer's process did not hand us over its socket
    (proof.py): its address, size or segment would be what a message claims."""
    proof = info.proof
    if proof is None or descriptor not in proof.descriptors:
        raise TransportError(f"{what}: peer {info.name!r} (process {info.pid}) did not vouch "
                             "for this buffer over its socket; nothing is written into memory "
                             "its process did not offer")


def open_host(info: ShmPeer, descriptor: bytes, allow_map: bool) -> Target:
    """A vouched host descriptor of `info` as a target: its segment mapped through the memfd
    the peer handed over, else process_vm_writev into the proved pid."""
    _, fd, seg_n, off, addr, n = parse_descriptor(descriptor)
    memfd = info.proof.fds.get(fd) if fd >= 0 and info.proof is not None else None
    return open_target(info.pid, memfd, seg_n, off, addr, n, allow_map, info.maps, key=fd)


__all__ = ["check_vouched", "descriptor_pid", "open_host", "open_remote"]
