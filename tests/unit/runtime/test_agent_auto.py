"""Two real agents over transport=auto (shm + tcp, real sockets on 127.0.0.1).

Same host: the prefill writes one-sided over shm. A peer whose address carries another host
identity (as one on another machine would send it) is reached over tcp: the prefill's
transport says it cannot write to that peer (`can_write`), the agent says so as a warning
and the room goes two-sided, byte-exact.
"""

from __future__ import annotations

import logging

import pytest

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.pool import PagePool
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent
from kvhandoff.transports.auto import AutoTransport, decode_address, encode_address

from .conftest import Pair, Releases, Side, tiny_layout
from .test_agent_inproc import PREFIX, SEQ, expected_bytes, finish, run_layers

OTHER_HOST = b"\xee" * 16


class OtherHostAuto(AutoTransport):
    """An auto transport whose address says it runs on another host."""

    @property
    def address(self) -> bytes:
        a = decode_address(super().address)
        return encode_address(OTHER_HOST, a.shm, a.cross_kind, a.cross, pidns=a.pidns)


def make_pair(other_host: bool) -> Pair:
    layout = tiny_layout()
    settings = Settings(transport="auto", auto_cross_host="tcp", heartbeat_interval_s=1.0)
    sides = []
    for i, role in enumerate(("prefill", "decode")):
        tr = OtherHostAuto(settings) if other_host else AutoTransport(settings)
        pool = PagePool(32, seed=i + 1)
        agent = TransferAgent(role, layout, allocate(layout, 32), settings,
                              engine_id=f"auto-{role}", transport=tr)
        sides.append(Side(agent=agent, pool=pool, releases=Releases(pool)))
    return Pair(sides[0], sides[1])


@pytest.mark.parametrize("other_host", [False, True], ids=["same-host", "other-host"])
def test_auto_handoff_one_sided_on_shm_two_sided_across_hosts(
        other_host: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pr = make_pair(other_host)
    try:
        sender, receiver, _, dst = pr.open(21, SEQ, PREFIX)
        run_layers(pr, sender, receiver)
        assert [p.name for p in finish(sender, receiver)] == ["Success", "Success"]
        bad, touched = pr.verify(dst, SEQ, PREFIX)
        assert bad == 0 and touched == 0
        assert receiver.stats()["bytes"] == expected_bytes(pr, SEQ, PREFIX)
        one_sided = sender.stats()["one_sided"]
        tr = pr.prefill.agent.transport
        assert isinstance(tr, AutoTransport)
        peer_routes = set(tr.routes().values())
        refused = [r.getMessage() for r in caplog.records
                   if "one-sided writes refused" in r.getMessage()]
        if other_host:
            assert peer_routes == {"tcp"}
            assert one_sided is False
            assert refused and "the auto transport's lane to peer" in refused[0]
            assert "has no one-sided writes" in refused[0]
            assert tr.status().degraded  # a connected peer uses the tcp lane
        else:
            assert peer_routes == {"shm"}
            assert one_sided is True and not refused
            assert not tr.status().degraded
    finally:
        pr.decode.agent.close()
        pr.prefill.agent.close()
