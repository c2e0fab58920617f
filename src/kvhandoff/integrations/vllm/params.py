"""`kv_transfer_params`: what travels through vLLM's proxy between the prefill and the decode.

The prefill returns them from `request_finished`; vLLM's example proxy copies them into the
decode request. The keys NixlConnector uses keep their meaning (``do_remote_prefill``,
``do_remote_decode``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``remote_block_ids``, ``tp_size``); kvhandoff adds ``remote_room`` (the room
id), ``remote_bootstrap_addr`` (the prefill's bootstrap server, ``host:port``, which also gives
``remote_host``/``remote_port``), ``remote_num_tokens`` (the sequence the prefill sends) and
``decode_tp_size``.

Resuming a request (``kvhandoff route``: a drained or lost decode's request continues on
another): ``kvhandoff_resume: true`` says the room covers only the first ``remote_num_tokens``
tokens of the decode request's prompt (the original prompt; the prompt it is sent with is that
plus the tokens already generated). The decode loads those and computes the rest itself.

Decode TP size: a prefill rank opens each room for the decode ranks that will read it from
that rank, so it must know the decode's TP size before the decode exists (NixlConnector learns
it later, from the count each reader's completion notice carries; a kvhandoff room is opened
with its readers). It comes with the prefill request (``kv_transfer_params.decode_tp_size``:
the proxy knows which decode it picked), else from the prefill's ``decode_tp_size`` setting,
else it is the prefill's own. The prefill hands it back; a decode of another TP size, whose
ranks would not be the readers the room waits for, computes the prompt itself and says why.

Pure: no I/O. Bad params raise `ConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from kvhandoff.errors import ConfigError
from kvhandoff.netaddr import join_host_port, split_host_port

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
    prefill_tp_size: int = 1
    decode_tp_size: int | None = None  # the decode TP the room was opened for (None: not said)
    window_start: int = 0  # a sliding window: the first token whose page the prefill holds
    # ``kvhandoff_resume``: the room may cover a prefix of the prompt only (module docstring)
    resume: bool = False

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
            addr = join_host_port(host, port)
        if not isinstance(addr, str) or not addr:
            raise ConfigError("kv_transfer_params.remote_bootstrap_addr: missing (or give "
                              "remote_host and remote_port)")
        n = _int(params, "remote_num_tokens", lo=1, hi=1 << 40)
        eng = params.get("remote_engine_id", "")
        rid = params.get("remote_request_id", "")
        if not isinstance(eng, str) or not isinstance(rid, str):
            raise ConfigError("kv_transfer_params.remote_engine_id/remote_request_id: expected "
                              "strings")
        ptp = _int(params, "tp_size", lo=1, hi=1 << 16) if "tp_size" in params else 1
        dtp = (_int(params, "decode_tp_size", lo=1, hi=1 << 16) if "decode_tp_size" in params
               else None)
        ws = (_int(params, "remote_window_start", lo=0, hi=n) if "remote_window_start" in params
              else 0)
        resume = params.get("kvhandoff_resume", False)
        if not isinstance(resume, bool):
            raise ConfigError(f"kv_transfer_params.kvhandoff_resume: expected true or false, "
                              f"got {resume!r}")
        return cls(room=room, bootstrap_addr=addr, num_tokens=n, engine_id=eng, request_id=rid,
                   prefill_tp_size=ptp, decode_tp_size=dtp, window_start=ws, resume=resume)


def decode_tp_size_of(params: Mapping[str, Any], *, default: int | None,
                      prefill_tp_size: int) -> int | None:
    """The decode TP size a prefill request asks for (``decode_tp_size``, else `default`; None:
    not said, the decode ranks tell the prefill how many read it); raises `ConfigError` naming
    the field when it is not a TP size this prefill can serve."""
    n = _int(params, "decode_tp_size", lo=1, hi=1 << 16) if "decode_tp_size" in params \
        else default
    if n is None:
        return None
    if n % prefill_tp_size and prefill_tp_size % n:
        raise ConfigError(f"kv_transfer_params.decode_tp_size: {n} and the prefill's TP size "
                          f"{prefill_tp_size} must divide one another")
    return n


def decode_readers(prefill_tp_rank: int, prefill_tp_size: int, decode_tp_size: int, *,
                   replicated: bool) -> int:
    """How many decode ranks of `decode_tp_size` read a room from prefill rank
    `prefill_tp_rank` (the bootstrap server's rank mapping; a replicated cache, MLA, is read
    from one prefill rank per decode rank, so a prefill rank may have none)."""
    from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks

    return sum(prefill_tp_rank in prefill_tp_ranks(d, decode_tp_size, prefill_tp_size,
                                                   replicated=replicated)
               for d in range(decode_tp_size))


def readers_of(decode_tp_rank: int, decode_tp_size: int, prefill_tp_size: int, *,
                replicated: bool) -> int:
    """What decode rank `decode_tp_rank` tells each prefill rank it reads: how many decode
    ranks of its TP size read that prefill rank (the same for every prefill rank it reads;
    `ConfigError` when the sizes do not divide one another)."""
    from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks

    first = prefill_tp_ranks(decode_tp_rank, decode_tp_size, prefill_tp_size,
                             replicated=replicated)[0]
    return decode_readers(first, prefill_tp_size, decode_tp_size, replicated=replicated)


def readers_agree(prefill_tp_size: int, room_decode_tp: int, decode_tp: int, *,
                  replicated: bool) -> bool:
    """A room opened for decode TP `room_decode_tp` has, on every prefill rank, the readers a
    decode of TP `decode_tp` brings (GQA: any decode TP up to the prefill's reads each prefill
    rank once)."""
    try:
        return all(decode_readers(p, prefill_tp_size, room_decode_tp, replicated=replicated)
                   == decode_readers(p, prefill_tp_size, decode_tp, replicated=replicated)
                   for p in range(prefill_tp_size))
    except ConfigError:
        return False


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
    try:
        return split_host_port(addr.split("://", 1)[-1].rstrip("/"))
    except ValueError as e:
        raise ConfigError(f"bootstrap_url: {e}") from e
