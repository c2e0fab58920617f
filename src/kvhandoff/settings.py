"""One `Settings` for the whole product (server and agents).

Rules: built in `main()` / `create_app()` / `TransferAgent(...)`, never at import time; every
field is settable by a `KVHANDOFF_<FIELD>` environment variable and most by a CLI flag. The
layout is not a setting: it is a value both sides exchange and hash.

`listener_auth` is the one decision every listener takes before it binds (the agents' control
socket, the bootstrap server; doctor asks it too): a non-loopback address without its secret
is a refusal naming the setting, unless `allow_unauthenticated` says otherwise out loud.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from enum import Enum

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout.admission import AllocationPolicy

log = logging.getLogger("kvhandoff.settings")


class ChecksumMode(str, Enum):
    """How landed bytes are verified."""

    FULL = "full"
    SAMPLED = "sampled"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


class TransportKind(str, Enum):
    """The data transport of an agent."""

    UCX = "ucx"
    TCP = "tcp"
    SHM = "shm"  # same host: writes into the peer's memory (transfer/transports/shm.py)
    NIXL = "nixl"  # one-sided writes through NIXL (RDMA where its UCX has verbs)
    AUTO = "auto"  # shm with peers on this host, the cross-host transport with the others
    INPROC = "inproc"

    def __str__(self) -> str:
        return self.value


class Settings(BaseSettings):
    """Settings of a kvhandoff process. Environment variables use the prefix ``KVHANDOFF_``."""

    model_config = SettingsConfigDict(env_prefix="KVHANDOFF_", extra="ignore")

    @field_validator("host_staging")
    @classmethod
    def _host_staging(cls, v: str) -> str:
        if v not in ("auto", "on", "off"):
            raise ValueError(f"host_staging must be auto, on or off, got {v!r}")
        return v

    @field_validator("auto_cross_host")
    @classmethod
    def _cross_host_kind(cls, v: TransportKind) -> TransportKind:
        if v not in (TransportKind.UCX, TransportKind.TCP, TransportKind.NIXL):
            raise ValueError(f"auto_cross_host must be ucx, tcp or nixl (a transport that "
                             f"reaches other hosts), got {v.value!r}")
        return v

    # --- bootstrap server -------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the bootstrap server binds. Use 0.0.0.0 "
                      "(with auth_token) for a real deployment.")
    port: int = Field(8998, ge=0, le=65535,
                      description="Port of the bootstrap server (0 = any free).")
    auth_token: SecretStr | None = Field(
        None, description="Bearer token required on every write route (and sent by agents). "
        "Required when host is not a loopback address: a server that would listen there "
        "without it refuses to start (see allow_unauthenticated).")
    rank_ttl_s: float = Field(30.0, gt=0, description="A rank that sends no heartbeat for this "
                              "long is dropped and readiness falls back to not-ready.")
    max_body_bytes: int = Field(1 << 20, gt=0,
                                description="Largest request body the server accepts.")
    room_retention_s: float = Field(600.0, gt=0, description="How long finished or aborted rooms "
                                    "stay visible to lookups (server) and in an agent's status "
                                    "before they are forgotten.")
    max_live_rooms: int = Field(
        1_000_000, gt=0, description="Most rooms the bootstrap server holds at once (allocated, "
        "bound or aborted, until room_retention_s after their last change). Every route that "
        "adds a room (allocate, bind, abort of an unknown room, SGLang's register_dp_rank) is "
        "refused with 503 past it.")
    max_world_size: int = Field(
        1024, gt=0, le=65536, description="Largest engine the bootstrap server takes: a "
        "registration whose dp x tp x cp x pp is larger is refused with 400 naming the sizes "
        "(SGLang's PUT /route too). Ranks per engine are bounded by it.")
    max_engines: int = Field(
        256, gt=0, description="Most engines the bootstrap server knows at once (an engine is "
        "forgotten when its last rank deregisters or misses rank_ttl_s). A registration that "
        "would add one more is refused with 409 naming engine_id and the bound.")
    max_live_ranks: int = Field(
        65536, gt=0, description="Most ranks the bootstrap server holds at once, all engines "
        "together. A registration of a new rank past it is refused with 409.")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")
    route_access_log: bool = Field(
        False, description="Write an access-log line for every answered GET /route (SGLang's "
        "per-request rank lookup, thousands a second). Off: a GET /route answer gets one only "
        "when it is an error (status 400 or above); every other request gets its access line "
        "at log level info either way, and slow ones a warning (slow_request_s).")
    slow_request_s: float = Field(1.0, gt=0, description="A request the bootstrap server takes "
                                  "longer than this to answer is logged as a warning with its "
                                  "duration (any route).")

    # --- agents -----------------------------------------------------------------------------
    bootstrap_url: str | None = Field(None, description="URL of the bootstrap server an agent "
                                      "registers with / looks routes up at.")
    transport: TransportKind = Field(
        TransportKind.AUTO, description="Data transport: auto (default: shm with peers on this "
        "host, auto_cross_host with the others), ucx, tcp, nixl (one-sided writes through NIXL's "
        "bundled UCX: RDMA from a pip install of the nixl extra), shm (same host only) or "
        "inproc. Both sides of a pair must use the same kind (a Hello of another kind is "
        "refused naming both).")
    auto_cross_host: TransportKind = Field(
        TransportKind.UCX, description="transport=auto: the transport for peers on other hosts "
        "(ucx, tcp or nixl; peers on this host use shm). Set it alike on both sides.")
    require_rdma: bool = Field(False, description="Refuse the tcp transport and a UCX that found "
                               "only TCP lanes, instead of degrading (readiness fails).")
    ucx_same_host_error_handling: bool = Field(
        True, description="UCX peer error handling also for peers on this host. On (default): "
        "a same-host peer that dies never takes this process down, but UCX then gives same-host "
        "pairs TCP lanes only (reported as degraded); use transport=shm for the fast, safe "
        "same-host lane. Off: UCX's shared-memory lanes, but UCX aborts this process if such a "
        "peer dies mid-write (both sides must use the same value). Peers on other hosts always "
        "have error handling.")
    agent_host: str = Field("127.0.0.1", description="Address the agent's control socket binds.")
    agent_port: int = Field(0, ge=0, le=65535, description="Port of the agent's control socket "
                            "(0 = any free).")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Agent heartbeat to peers; a peer "
                                        "silent for 2 intervals is dead and its rooms fail, and "
                                        "an agent whose own process did not run for 2 "
                                        "intervals gives its rooms up. A process that exits is "
                                        "found sooner on most lanes (its connection or process "
                                        "ends); the silence finds one frozen or cut off. Lower "
                                        "it (e.g. 0.5) only where the host is never busy and "
                                        "links do not drop packets.")
    lease_s: float = Field(10.0, gt=0, description="A room's lease; decode renews it by heartbeat.")
    bootstrap_timeout_s: float = Field(30.0, gt=0, description="Bound on Bootstrapping.")
    waiting_timeout_s: float = Field(300.0, gt=0, description="Bound on WaitingForInput (prefill "
                                     "computing before the first layer).")
    stall_timeout_s: float = Field(30.0, gt=0, description="A transfer with no progress for this "
                                   "long fails.")
    checksum: ChecksumMode = Field(ChecksumMode.FULL, description="full, sampled or off.")
    one_sided_writes: bool = Field(
        True, description="Where the transport can write into a peer's memory (shm, nixl), the "
        "prefill writes each layer straight into the decode's pages (no receives, no staging, "
        "the checksum computed while copying). A transfer is one-sided only when the decode "
        "offers its buffers and the prefill takes them, so the two sides need not agree; off "
        "on either side: two-sided sends.")
    host_staging: str = Field(
        "auto", description="KV caches in CUDA memory on a transport that cannot reach device "
        "memory (tcp, ucx; auto whose lane to other hosts is one of them): auto (default) copies "
        "each layer's device pages through pinned host staging buffers (visible: status "
        "'staging', a start log line, the staged_bytes counters); on: stage always, also over "
        "nixl (hosts without GPUDirect RDMA) or shm; off: never stage (such a start is refused "
        "naming this setting). Host caches never stage.")
    host_staging_mib: int = Field(
        2048, gt=0, description="Host staging: MiB of the pinned host arena each staging "
        "agent makes on first use and reuses; layers that do not fit wait for earlier ones "
        "to free it (a room larger than the arena passes layer by layer), a layer larger than "
        "the whole arena fails its room naming this setting.")
    write_quarantine_s: float = Field(
        10.0, gt=0, description="One-sided writes: when the prefill of a room is lost mid-"
        "transfer, the decode fails the room at once but holds its pages this long before "
        "releasing them (a stopped, not dead, prefill could still write into them), and never "
        "less than stall_timeout_s + 2 heartbeats (the writer's own bound on stopping a "
        "copy). A Failed, Abort or AbortAck from the prefill releases them at once.")
    allocation_policy: AllocationPolicy = Field(
        AllocationPolicy.EARLY, description="When the decode reserves a request's pages "
        "(SGLang's --disaggregation-decode-allocation-policy): early (the transfer request "
        "carries the pages reserved) or prefill_complete (it carries the free pages). Both "
        "sides must agree; a request that does not fit is refused before any byte moves.")
    chunk_bytes: int = Field(4 << 20, gt=0, description="Largest data message on the transport.")
    layout_probe: bool = Field(
        True, description="At start, write known keys and values for a few token slots into "
        "scratch pages through the engine's own cache-write op and read them back through the "
        "layout the adapter built; refuse to start on any difference. Off: the layout is "
        "trusted unchecked (said in the log, the adapter's status and doctor).")
    hmac_secret: SecretStr | None = Field(
        None, description="Shared secret authenticating agent Hello messages (HMAC-SHA256), the "
        "same on every agent. Required when agent_host is not a loopback address: an agent "
        "that would listen there without it refuses to start (see allow_unauthenticated).")
    allow_unauthenticated: bool = Field(
        False, description="Let an agent listen on a non-loopback agent_host without "
        "hmac_secret, and the bootstrap server on a non-loopback host without auth_token. Off "
        "(default): either refuses to start, naming the setting to set. On: they start, warn "
        "in the log, and say auth off in their status, /ready, metrics and doctor.")
    max_message_bytes: int = Field(16 << 20, gt=0, description="Largest control message accepted.")
    tcp_early_bytes: int = Field(
        1 << 30, gt=0, description="tcp and ucx transports: bytes of chunks a receiver holds "
        "for receives not posted yet, per peer on tcp, per stream on ucx (a UCX tag does not "
        "name its sender; each message counted at its length + 1 KiB), 4 times that in all; "
        "over it that stream's chunks are dropped and counted (data_early_dropped), its "
        "receive fails (tcp: its sender too; the room fails or is retried). Held chunks are "
        "dropped likewise after stall_timeout_s.")
    local_control_lane: bool = Field(
        True, description="Agents of one host (one network namespace) send each other control "
        "messages over a Unix socket named after the control address, written and read by "
        "their control threads, instead of ZMQ's TCP (no I/O-thread hops: a message's latency "
        "about a tenth). A peer elsewhere is reached over TCP as before. Off: TCP only.")
    agent_metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve the agent's "
                                           "Prometheus metrics on this port (0 = any free; unset "
                                           "= not served).")


class AuthMode(str, Enum):
    """How a listener (an agent's control socket, the bootstrap server) authenticates peers."""

    SECRET = "secret"  # hmac_secret (agents) / auth_token (bootstrap server) is set
    LOOPBACK = "loopback"  # no secret, but only this host can reach the listener
    OFF = "off"  # no secret on an address others reach: allowed by allow_unauthenticated

    def __str__(self) -> str:
        return self.value


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an address or a name, IPv6 with or without brackets) reaches this host
    only: a loopback literal, or a name every address of which is loopback. A wildcard
    (``0.0.0.0``, ``::``) or a name that does not resolve is not."""
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def listener_auth(settings: Settings, *, what: str, host_setting: str,
                  secret_setting: str, warn: bool = True) -> AuthMode:
    """The `AuthMode` of a listener about to bind ``settings.<host_setting>``; refuses one on a
    non-loopback address without ``settings.<secret_setting>`` unless
    ``allow_unauthenticated`` is set (then it warns: the caller shows ``auth: off``).

    Raises:
        ConfigError: naming both settings and how to set them.
    """
    if getattr(settings, secret_setting) is not None:
        return AuthMode.SECRET
    host = getattr(settings, host_setting)
    if is_loopback_host(host):
        return AuthMode.LOOPBACK
    env = f"KVHANDOFF_{secret_setting.upper()}"
    if not settings.allow_unauthenticated:
        raise ConfigError(
            f"{what}: {host_setting}={host!r} is not a loopback address and {secret_setting} "
            f"is unset, so anyone who reaches it could talk to it unauthenticated; set "
            f"{secret_setting} ({env}, a random secret, e.g. `openssl rand -hex 32`, the same "
            f"on every agent and server of the deployment), or bind a loopback address, or "
            f"set allow_unauthenticated (KVHANDOFF_ALLOW_UNAUTHENTICATED=true) to run without "
            f"one")
    if warn:
        log.warning("%s: listening on %s=%r WITHOUT authentication (%s unset, "
                    "allow_unauthenticated set): anyone who reaches it can talk to it; set %s",
                    what, host_setting, host, secret_setting, env)
    return AuthMode.OFF
