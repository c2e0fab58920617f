"""`kv_transfer_params`: what travels through vLLM's proxy between the prefill and the decode.

The prefill returns them from `request_finished`; vLLM's example proxy copies them into the
decode request. The keys NixlConnector uses keep their meaning (``do_remote_prefill``,
``do_remote_decode``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``remote_block_ids``, ``tp_size``); kvhandoff adds ``remote_room`` (the room
id), ``remote_bootstrap_addr`` (the prefill's bootstrap server, ``host:port``, which also gives
``remote_host``/``remote_port``) and ``remote_num_tokens`` (the sequence the prefill sends).

Pure: no I/O. Bad params raise `ConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from kvhandoff.errors import ConfigError

ROOM_MASK = (1 << 63) - 1


def room_of(engine_id: str, request_id: str) -> int:
    """The room of a prefill request: a 63-bit hash of (engine, request), never 0."""
    return (xxhash.xxh3_64_intdigest(f"{engine_id}\0{request_id}".encode()) & ROOM_MASK) or 1


@dataclass(frozen=True)
class RemotePrefill:
    """The decode's view of a request whose KV a prefill engine computed."""

    room: int
    bootstrap_addr: str
    num_tokens: int
    engine_id: str
    request_id: str

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """From `kv_transfer_params`; raises `ConfigError` naming the bad field."""
        room = _int(params, "remote_room", lo=1, hi=ROOM_MASK)
        addr = params.get("remote_bootstrap_addr")
        if addr is None and "remote_host" in params and "remote_port" in params:
            host = params["remote_host"]
            port = _int(params, "remote_port", lo=1, hi=65535)
            if not isinstance(host, str) or not host:
                raise ConfigError("kv_transfer_params.remote_host: expected a host name")
            addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if not isinstance(addr, str) or not addr:
            raise ConfigError("kv_transfer_params.remote_bootstrap_addr: missing (or give "
                              "remote_host and remote_port)")
        n = _int(params, "remote_num_tokens", lo=1, hi=1 << 40)
        eng = params.get("remote_engine_id", "")
        rid = params.get("remote_request_id", "")
        if not isinstance(eng, str) or not isinstance(rid, str):
            raise ConfigError("kv_transfer_params.remote_engine_id/remote_request_id: expected "
                              "strings")
        return cls(room=room, bootstrap_addr=addr, num_tokens=n, engine_id=eng, request_id=rid)


def _int(params: Mapping[str, Any], key: str, *, lo: int, hi: int) -> int:
    if key not in params:
        raise ConfigError(f"kv_transfer_params.{key}: missing")
    v = params[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"kv_transfer_params.{key}: expected an integer, got "
                          f"{type(v).__name__}")
    if not lo <= v <= hi:
        raise ConfigError(f"kv_transfer_params.{key}: expected {lo}..{hi}, got {v}")
    return v


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``http://host:port`` -> (host, port)."""
    a = addr.split("://", 1)[-1].rstrip("/")
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"bootstrap_url: expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)
