"""kv_transfer_params parsing (pure; runs without vLLM): every bad field is named."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.params import (
    ROOM_MASK,
    RemotePrefill,
    decode_readers,
    decode_tp_size_of,
    readers_agree,
    room_of,
    split_addr,
)

GOOD: dict[str, Any] = {"do_remote_prefill": True, "remote_room": 77,
                        "remote_bootstrap_addr": "127.0.0.1:8998", "remote_num_tokens": 40,
                        "remote_engine_id": "p0", "remote_request_id": "r1"}


def test_parse() -> None:
    rp = RemotePrefill.parse(GOOD)
    assert (rp.room, rp.bootstrap_addr, rp.num_tokens, rp.engine_id, rp.request_id) == (
        77, "127.0.0.1:8998", 40, "p0", "r1")
    host_port = {k: v for k, v in GOOD.items() if k != "remote_bootstrap_addr"}
    rp = RemotePrefill.parse({**host_port, "remote_host": "::1", "remote_port": 8998})
    assert rp.bootstrap_addr == "[::1]:8998"


@pytest.mark.parametrize("change,field", [
    ({"remote_room": None}, "remote_room"),
    ({"remote_room": 0}, "remote_room"),
    ({"remote_room": True}, "remote_room"),
    ({"remote_room": ROOM_MASK + 1}, "remote_room"),
    ({"remote_num_tokens": "40"}, "remote_num_tokens"),
    ({"remote_num_tokens": 0}, "remote_num_tokens"),
    ({"remote_bootstrap_addr": ""}, "remote_bootstrap_addr"),
    ({"remote_engine_id": 3}, "remote_engine_id"),
    ({"tp_size": 0}, "tp_size"),
    ({"decode_tp_size": "2"}, "decode_tp_size"),
])
def test_bad_fields_are_named(change: dict[str, Any], field: str) -> None:
    params = {**GOOD, **change}
    params = {k: v for k, v in params.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        RemotePrefill.parse(params)


def test_rooms_are_63_bit_nonzero_and_per_engine() -> None:
    rooms = {room_of(e, f"r{i}") for e in ("a", "b") for i in range(1000)}
    assert len(rooms) == 2000
    assert all(0 < r <= ROOM_MASK for r in rooms)
    assert room_of("a", "r1") == room_of("a", "r1")


def test_split_addr() -> None:
    assert split_addr("http://127.0.0.1:8998/") == ("127.0.0.1", 8998)
    assert split_addr("[::1]:9") == ("::1", 9)
    with pytest.raises(ConfigError, match="host:port"):
        split_addr("127.0.0.1")


def test_decode_tp_size_of_a_prefill_request() -> None:
    assert decode_tp_size_of({}, default=1, prefill_tp_size=1) == 1
    assert decode_tp_size_of({"decode_tp_size": 4}, default=1, prefill_tp_size=2) == 4
    assert decode_tp_size_of({}, default=2, prefill_tp_size=4) == 2
    with pytest.raises(ConfigError, match="decode_tp_size: 3 and the prefill's TP size 2"):
        decode_tp_size_of({"decode_tp_size": 3}, default=1, prefill_tp_size=2)
    with pytest.raises(ConfigError, match="decode_tp_size"):
        decode_tp_size_of({"decode_tp_size": 0}, default=1, prefill_tp_size=1)


def test_decode_readers_cases() -> None:
    # the decode ranks each prefill rank opens a room for (the bootstrap server's mapping)
    assert decode_readers(0, 1, 2, replicated=False) == 2  # TP 1 -> TP 2: both heads' ranks
    assert [decode_readers(p, 2, 1, replicated=False) for p in (0, 1)] == [1, 1]  # GQA 2 -> 1
    assert [decode_readers(p, 2, 1, replicated=True) for p in (0, 1)] == [1, 0]  # MLA 2 -> 1
    assert [decode_readers(p, 2, 4, replicated=False) for p in (0, 1)] == [2, 2]
    assert [decode_readers(p, 4, 2, replicated=True) for p in range(4)] == [1, 1, 0, 0]


def test_readers_agree() -> None:
    assert readers_agree(1, 1, 1, replicated=False)
    assert not readers_agree(1, 2, 1, replicated=False)  # the room waits for two readers
    assert readers_agree(2, 2, 1, replicated=False)  # GQA: one reader per prefill rank either way
    assert not readers_agree(2, 2, 1, replicated=True)  # MLA: prefill rank 1 has none at TP 1
    assert not readers_agree(2, 2, 3, replicated=False)  # 3 and 2 do not divide


def test_resume_flag() -> None:
    """``kvhandoff_resume`` (a request continued on another decode by ``kvhandoff route``):
    off unless said, a boolean or refused naming the field."""
    assert RemotePrefill.parse(GOOD).resume is False
    assert RemotePrefill.parse({**GOOD, "kvhandoff_resume": True}).resume is True
    with pytest.raises(ConfigError, match="kv_transfer_params.kvhandoff_resume"):
        RemotePrefill.parse({**GOOD, "kvhandoff_resume": "yes"})
