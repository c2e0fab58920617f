"""Which transport moves an engine's KV caches, decided at start from where they live.

Rule: a connector never starts with a transport that cannot move its caches. Host memory: the
settings stand as given. CUDA memory: only the shm transport (its CUDA IPC lane, same host,
one-sided writes) and the nixl transport (VRAM registration, any host) move it, so

- ``transport = auto`` (the default) with ``auto_cross_host`` left unset takes nixl for peers
  on other hosts (shm stays the lane for peers on this host), and the start log says so;
- anything else that cannot move device memory (``transport`` ucx, tcp or inproc; ``auto`` with
  ``auto_cross_host`` set to ucx or tcp; one-sided writes off, which leaves the shm lane
  nothing to move device memory with) is refused with the setting to change.

Pure: no vLLM, no I/O; the worker calls `choose_lane` with the kind `buffers.devsum.memory_kind`
reads off the caches (``"host"`` or ``"cuda"``).
"""

from __future__ import annotations

from kvhandoff.errors import ConfigError
from kvhandoff.settings import Settings
from kvhandoff.transports.base import TransportKind

#: transports that register CUDA memory (shm: same host, one-sided writes only)
DEVICE_KINDS = (TransportKind.SHM, TransportKind.NIXL)


def choose_lane(settings: Settings, memory: str) -> tuple[Settings, str]:
    """The settings the agent starts with for caches in `memory` ("host" or "cuda"), and one
    line for the start log saying which lanes will carry them.

    Raises:
        ConfigError: the settings name a transport that cannot move `memory`; the message
            names the setting and the value to use.
    """
    kind = settings.transport
    cross = settings.auto_cross_host
    if memory != "cuda":
        where = (f"shm with peers on this host, {cross} with other hosts"
                 if kind is TransportKind.AUTO else str(kind))
        return settings, f"KV caches in host memory: transport {kind} ({where})"
    fix = ("leave transport unset (auto: shm with peers on this host, nixl with other hosts) "
           "or set it to nixl")
    if kind not in (TransportKind.AUTO, *DEVICE_KINDS):
        raise ConfigError(f"settings.transport={kind}: the KV caches are CUDA memory and the "
                          f"{kind} transport moves host memory only; {fix}")
    if kind is TransportKind.AUTO:
        if "auto_cross_host" not in settings.model_fields_set:
            settings = settings.model_copy(update={"auto_cross_host": TransportKind.NIXL})
            cross = TransportKind.NIXL
        elif cross not in DEVICE_KINDS:
            raise ConfigError(f"settings.auto_cross_host={cross}: the KV caches are CUDA memory "
                              f"and the {cross} transport moves host memory only; set "
                              "auto_cross_host to nixl (or leave it unset: nixl is then the "
                              "default for CUDA caches)")
    if kind is not TransportKind.NIXL and not settings.one_sided_writes:
        raise ConfigError(f"settings.one_sided_writes=false: the KV caches are CUDA memory and "
                          f"the {kind} transport's same-host lane moves device memory with "
                          "one-sided writes only (CUDA IPC); leave one_sided_writes on")
    if kind is TransportKind.AUTO:
        return settings, ("KV caches in CUDA memory: transport auto (shm's CUDA IPC lane with "
                          f"peers on this host, {cross} with other hosts)")
    if kind is TransportKind.SHM:
        return settings, ("KV caches in CUDA memory: transport shm (CUDA IPC, peers on this "
                          "host only)")
    return settings, "KV caches in CUDA memory: transport nixl (VRAM registration)"
