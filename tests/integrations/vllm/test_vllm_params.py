"""kv_transfer_params parsing (pure; runs without vLLM): every bad field is named."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.params import ROOM_MASK, RemotePrefill, room_of, split_addr

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
