"""Which transport moves an engine's KV caches, decided at start from where they live: the one
choice of every integration (the vLLM connector's worker, the SGLang backend's manager, per
agent).

Rule: an integration never starts an agent with a transport that cannot move its buffers.
Host memory: the settings stand as given. CUDA memory: only the shm transport (its CUDA IPC
lane, same host, one-sided writes) and the nixl transport (VRAM registration, any host) move
it, so

- ``transport = auto`` (the default) with ``auto_cross_host`` left unset takes nixl for peers
  on other hosts (shm stays the lane for peers on this host), and the start log says so;
- a transport that cannot reach device memory (``transport`` ucx, tcp or inproc; ``auto``
  with ``auto_cross_host`` set to ucx or tcp) moves it through host staging
  (`runtime.staging`, the agent's own choice from the same settings), and the start log line
  says so; with ``host_staging=off`` it is refused with the setting to change, as is
  one-sided writes off on a direct lane (which leaves the shm lane nothing to move device
  memory with); ``host_staging=on`` stages on every lane (nixl without GPUDirect RDMA);
- a choice that needs NIXL (``transport`` nixl, or ``auto`` whose lane to other hosts is nixl)
  on a host where NIXL is not installed is refused at start with the install line
  (`NIXL_INSTALL`), instead of the agent failing when it first builds the transport.

Pure but for one ``importlib.util.find_spec`` (no import of NIXL): the caller passes the memory
kind `buffers.devsum.memory_kind` reads off its buffers (``"host"`` or ``"cuda"``), and a test
may pass `nixl_missing` to stand for a host without NIXL.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from kvhandoff.errors import ConfigError
from kvhandoff.settings import Settings
from kvhandoff.transports.base import TransportKind

__all__ = ["DEVICE_KINDS", "NIXL_INSTALL", "buffers_memory", "choose_lane", "nixl_missing"]

#: transports that register CUDA memory (shm: same host, one-sided writes only)
DEVICE_KINDS = (TransportKind.SHM, TransportKind.NIXL)

#: the install line that brings the nixl transport (also part of the vllm and sglang extras)
NIXL_INSTALL = "pip install 'kvhandoff[nixl]'"


def nixl_missing() -> str | None:
    """Why the nixl transport cannot load on this host (None: its package is installed)."""
    try:
        found = importlib.util.find_spec("nixl_cu12") is not None
    except (ImportError, ValueError) as e:
        return f"nixl_cu12 cannot be found: {e}"
    return None if found else "the nixl_cu12 package is not installed"


def choose_lane(settings: Settings, memory: str, *,
                missing: Callable[[], str | None] | None = None) -> tuple[Settings, str]:
    """The settings an agent starts with for buffers in `memory` ("host" or "cuda"), and one
    line for the start log saying which lanes will carry them.

    Args:
        settings: the agent's settings as configured.
        memory: where the agent's buffers live.
        missing: says why NIXL cannot load here (None: it can); default: `nixl_missing`, looked
            up at each call (a test replaces it to stand for a host without NIXL).

    Raises:
        ConfigError: the settings name a transport that cannot move `memory`, or one this host
            cannot load; the message names the setting and the value to use (or the install
            line).
    """
    missing = missing or nixl_missing
    kind = settings.transport
    cross = settings.auto_cross_host
    if memory != "cuda":
        where = (f"shm with peers on this host, {cross} with other hosts"
                 if kind is TransportKind.AUTO else str(kind))
        _need_nixl(kind, cross, "host", missing, chosen=False)
        return settings, f"KV caches in host memory: transport {kind} ({where})"
    fix = ("leave transport unset (auto: shm with peers on this host, nixl with other hosts) "
           "or set it to nixl")
    staged = settings.host_staging != "off"
    off = ("; settings.host_staging=off (host_staging=auto moves device pages through pinned "
           "host buffers)")
    if kind not in (TransportKind.AUTO, *DEVICE_KINDS):
        if staged:
            return settings, _staged_line(settings, str(kind))
        raise ConfigError(f"settings.transport={kind}: the KV caches are CUDA memory and the "
                          f"{kind} transport moves host memory only; {fix}{off}")
    chosen = False
    if kind is TransportKind.AUTO:
        if "auto_cross_host" not in settings.model_fields_set:
            chosen = True
            settings = settings.model_copy(update={"auto_cross_host": TransportKind.NIXL})
            cross = TransportKind.NIXL
        elif cross not in DEVICE_KINDS:
            if staged:
                return settings, _staged_line(
                    settings, f"auto (shm with peers on this host, {cross} with other hosts)")
            raise ConfigError(f"settings.auto_cross_host={cross}: the KV caches are CUDA memory "
                              f"and the {cross} transport moves host memory only; set "
                              "auto_cross_host to nixl (or leave it unset: nixl is then the "
                              f"default for CUDA caches){off}")
    if settings.host_staging == "on":  # two-sided, through host staging on every lane
        _need_nixl(kind, cross, "cuda", missing, chosen=chosen)
        return settings, _staged_line(settings, str(kind) if kind is not TransportKind.AUTO else
                                      f"auto (shm with peers on this host, {cross} with other "
                                      "hosts)")
    if kind is not TransportKind.NIXL and not settings.one_sided_writes:
        raise ConfigError(f"settings.one_sided_writes=false: the KV caches are CUDA memory and "
                          f"the {kind} transport's same-host lane moves device memory with "
                          "one-sided writes only (CUDA IPC); leave one_sided_writes on")
    _need_nixl(kind, cross, "cuda", missing, chosen=chosen)
    if kind is TransportKind.AUTO:
        return settings, ("KV caches in CUDA memory: transport auto (shm's CUDA IPC lane with "
                          f"peers on this host, {cross} with other hosts)")
    if kind is TransportKind.SHM:
        return settings, ("KV caches in CUDA memory: transport shm (CUDA IPC, peers on this "
                          "host only)")
    return settings, "KV caches in CUDA memory: transport nixl (VRAM registration)"


def _staged_line(settings: Settings, lanes: str) -> str:
    """The start log line of CUDA caches that move through host staging."""
    why = ("settings.host_staging=on" if settings.host_staging == "on" else
           "the transport cannot reach device memory (host_staging=auto)")
    return (f"KV caches in CUDA memory: transport {lanes}, through HOST STAGING ({why}): each "
            "layer's device pages are copied through pinned host buffers "
            f"(at most host_staging_mib={settings.host_staging_mib})")


def _need_nixl(kind: TransportKind, cross: TransportKind, memory: str,
               missing: Callable[[], str | None], *, chosen: bool) -> None:
    """Refuses a lane choice that takes NIXL on a host without it, naming the install line."""
    if kind is TransportKind.NIXL:
        setting = "settings.transport=nixl"
    elif kind is TransportKind.AUTO and cross is TransportKind.NIXL:
        setting = ("settings.transport=auto (its lane to other hosts is nixl for CUDA caches)"
                   if chosen else "settings.auto_cross_host=nixl")
    else:
        return
    why = missing()
    if why is None:
        return
    alt = ("set transport=shm for peers on this host only" if memory == "cuda"
           else "choose another transport")
    raise ConfigError(f"{setting}: the KV caches are {memory} memory and this lane needs NIXL, "
                      f"which this host cannot load ({why}); install it with {NIXL_INSTALL} "
                      f"(the vllm and sglang extras bring it on Linux), or {alt}")


def buffers_memory(buffers: object, what: str) -> str:
    """Where an agent's buffers live ("host" or "cuda"; an empty set: "host"), read with
    `buffers.devsum.memory_kind` off every buffer of `buffers` (nested dicts and lists of
    tensors or array objects, as `BufferSet` takes them); one kind for all, else `ConfigError`
    naming `what`."""
    from kvhandoff.buffers.devsum import memory_kind

    kinds: set[str] = set()

    def walk(x: object) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif x is not None:
            kinds.add(memory_kind(x).kind)

    walk(buffers)
    if len(kinds) > 1:
        raise ConfigError(f"{what}: some buffers in {sorted(kinds)[0]} memory, some in "
                          f"{sorted(kinds)[1]} memory; one agent moves one kind")
    return kinds.pop() if kinds else "host"
