"""Security of the agents' control plane and data plane.

- HMAC on Hello: agents with different (or missing) shared secrets never handshake; their rooms
  fail fast with a clear reason (fast: failed by the handshake's refusal, not a deadline or a
  silence, with no byte moved; the time is printed). A process without the secret cannot join
  a room, and cannot abort one either.
- A decode may write only into pages it offered: the span plan of both sides targets exactly
  the offered pages (suffix pages for suffix-only regions), and every other byte of the decode
  buffers is untouched after real handoffs.
- Messages have a size limit, and the largest legitimate control message (the TransferRequest of
  a 1M-token GLM-5.3 context) fits under the default limit.
"""

from __future__ import annotations

import secrets
import time

import msgspec
import numpy as np
import pytest
from relkit import (
    WAIT_S,
    Engine,
    Prober,
    engine_pair,
    fast_settings,
    handoff,
    layers_of,
    plan_of,
    wait_until,
)

from kvhandoff.errors import ConfigError, FailureKind
from kvhandoff.kv_layout import SendFrom, preset
from kvhandoff.protocol import wire as P
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll

SEQ = 40


def room() -> int:
    return secrets.randbits(63)


def stale(e: Engine) -> int:
    return int(e.agent.status()["counters"]["stale_messages"])


@pytest.mark.parametrize(("prefill_secret", "decode_secret"),
                         [("s3cret-a", "s3cret-b"), ("s3cret-a", None), (None, "s3cret-b")])
def test_agents_with_different_secrets_cannot_handshake(prefill_secret: str | None,
                                                        decode_secret: str | None) -> None:
    """The decode room fails fast naming the HMAC (of the refused handshake's kind, before any
    byte moved; its time is printed, not bounded). Where the prefill has a secret, the refused
    decode is nobody to it: its Failed cannot touch the prefill room, which a decode with the
    right secret then still takes. Where only the decode has one, the prefill (which trusts
    anyone) accepted the Hello, so the decode's Failed ends the prefill room too."""
    with engine_pair(prefill_settings=fast_settings(hmac_secret=prefill_secret),
                     decode_settings=fast_settings(hmac_secret=decode_secret),
                     num_pages=8) as (p, d):
        r = room()
        s = p.send(r, SEQ)
        stale0 = stale(p)
        t0 = time.monotonic()
        rv = d.recv(r, SEQ, p.address)
        assert rv.wait(WAIT_S) is KVPoll.Failed
        assert "HMAC does not verify" in (rv.failure or ""), rv.failure
        assert rv.failure_kind is FailureKind.LAYOUT_MISMATCH, rv.failure_kind
        assert rv.stats()["bytes"] == 0
        assert rv.stats()["t_done"] > t0  # CLOCK_MONOTONIC is system-wide
        print(f"HMAC refused: decode room Failed in {(rv.stats()['t_done'] - t0) * 1e3:.1f} ms")
        assert d.bad_bytes(r, SEQ) > 0  # nothing landed
        assert d.wait_all_released([r], WAIT_S)
        d.assert_no_leak()
        if prefill_secret is None:
            assert s.wait(WAIT_S) is KVPoll.Failed
            assert "HMAC does not verify" in (s.failure or ""), s.failure
            assert s.failure_kind is FailureKind.LAYOUT_MISMATCH, s.failure_kind
            assert s.stats()["bytes"] == 0 and s.stats()["t_done"] > t0
        else:
            # The refused decode's Failed, then its heartbeats, reach the prefill over one
            # connection, in order; each is ignored (counted stale). Two ignored messages: the
            # Failed was among them (at most one heartbeat can precede it, in the millisecond
            # between its Hello and the HelloReject).
            assert wait_until(lambda: stale(p) - stale0 >= 2, WAIT_S)
            assert s.poll() is KVPoll.Bootstrapping, s
            good = Engine("decode", p.layout, 8, fast_settings(hmac_secret=prefill_secret))
            try:
                rv2 = good.recv(r, SEQ, p.address)
                assert rv2.wait(WAIT_S) is KVPoll.Success, rv2.failure
                assert good.bad_bytes(r, SEQ) == 0
            finally:
                good.close()
            assert s.wait(WAIT_S) is KVPoll.Success, s.failure
        assert p.wait_all_released([r], WAIT_S)
        p.assert_no_leak()


@pytest.mark.parametrize("transport", [None, "ucx"])
def test_same_secret_hands_off(transport: str | None) -> None:
    """(ucx: its two-sided tags keyed by the session, on both sides alike)"""
    if transport == "ucx":
        pytest.importorskip("ucxx")
    kw = {"transport": transport, "one_sided_writes": False} if transport else {}
    st = fast_settings(hmac_secret="shared-s3cret", **kw)
    with engine_pair(settings=st, num_pages=8) as (p, d):
        r = room()
        handoff(p, d, r, SEQ)
        assert d.bad_bytes(r, SEQ) == 0
        if transport == "ucx":  # the data plane is bound to the session: keyed tags
            assert p.address in d.agent._loop.transport._tag_keys  # type: ignore[attr-defined]


def test_process_without_the_secret_can_neither_join_nor_abort_a_room() -> None:
    st = fast_settings(hmac_secret="shared-s3cret")
    with engine_pair(settings=st, num_pages=8) as (p, d):
        r = room()
        s = p.send(r, SEQ, ready=False)
        with Prober(p.address) as pr:
            # a Hello without a valid MAC is refused, naming the reason
            layout = p.layout.to_dict()
            hello = P.Hello(src=pr.address, gen=pr.gen, agent_id="intruder", role="decode",
                            transport="tcp", transport_address=b"x", layout=layout,
                            layout_hash=p.agent.layout_hash, buffers=[],
                            mac=b"\x00" * 32)
            pr.send(P.encode(hello))
            ans = pr.recv(WAIT_S)
            assert isinstance(ans, P.HelloReject) and "HMAC" in ans.reason, ans
            # a request and an abort for the open room, as if handshaken: ignored
            req = P.TransferRequest(
                src=pr.address, gen=pr.gen, room=r, xfer=1, peer_gen=p.agent.generation,
                seq_len=SEQ, decode_prefix_len=0, page_size=16,
                dst_pages={"main_kv": [0, 1, 2], "indexer_k": [0, 1, 2]}, lease_s=5.0)
            pr.send(P.encode(req))
            pr.send(P.encode(P.Abort(src=pr.address, gen=pr.gen, room=r, reason="intruder")))
            got = pr.barrier("prefill")
            assert not any(isinstance(m, P.TransferAccepted) for m in got), got
        assert s.poll() is KVPoll.Bootstrapping, s
        # the room is still the real decode's to take
        rv = d.recv(r, SEQ, p.address)
        for lid in layers_of(p.layout):
            s.layer_ready(lid)
        assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
        assert s.wait(WAIT_S) is KVPoll.Success, s.failure
        assert d.bad_bytes(r, SEQ) == 0


def test_forged_abort_in_the_name_of_the_peer_is_ignored() -> None:
    """A third process sends Abort claiming to be the decode (its address) but cannot know the
    decode's generation nonce: the prefill counts it stale and the handoff completes."""
    with engine_pair(num_pages=8) as (p, d):
        r = room()
        layers = layers_of(p.layout)
        s = p.send(r, SEQ, ready=2)
        rv = d.recv(r, SEQ, p.address)
        assert rv.wait_for_layer(layers[1], WAIT_S)
        stale0 = p.agent.status()["counters"]["stale_messages"]
        with Prober(p.address) as pr:
            pr.send(P.encode(P.Abort(src=d.address, gen=pr.gen, room=r, reason="forged")))
            pr.barrier("prefill")
        assert p.agent.status()["counters"]["stale_messages"] > stale0
        for lid in layers[2:]:
            s.layer_ready(lid)
        assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
        assert s.wait(WAIT_S) is KVPoll.Success, s.failure


def test_decode_writes_only_into_the_pages_it_offered() -> None:
    untouched = 0xFF  # the sim/relkit patterns are < 251: 0xFF never lands legitimately
    with engine_pair(num_pages=24) as (p, d):
        layout = p.layout
        for _, view in d.agent.buffers.views():
            view[:] = untouched
        rooms = {room(): (SEQ, 0), room(): (100, 40), room(): (33, 32)}
        offered: dict[str, set[int]] = {reg.name: set() for reg in layout.regions}
        for r, (seq, prefix) in rooms.items():
            s, rv = handoff(p, d, r, seq, prefix=prefix)
            assert d.bad_bytes(r, seq) == 0
            pages = d.pages[r]
            ps = layout.page_size_tokens
            for reg in layout.regions:
                first = d.prefix[r] // ps if reg.send_from is SendFrom.DECODE_PREFIX else 0
                mine = set(pages[first:].tolist())
                offered[reg.name] |= mine
                pnb = reg.page_nbytes(ps)
                dplan = plan_of(d, r, reg.name)
                pplan = plan_of(p, r, reg.name)
                # both sides derived the same plan; every span lies inside offered pages
                assert np.array_equal(dplan.dst_offsets, pplan.dst_offsets)
                assert np.array_equal(dplan.nbytes, pplan.nbytes)
                first_page = dplan.dst_offsets // pnb
                last_page = (dplan.dst_offsets + dplan.nbytes - 1) // pnb
                assert set(first_page.tolist()) | set(last_page.tolist()) <= mine, reg.name
        for reg in layout.regions:
            pnb = reg.page_nbytes(layout.page_size_tokens)
            others = sorted(set(range(d.pool.num_pages)) - offered[reg.name])
            assert others
            for lid in reg.layer_ids:
                rows = d.agent.buffers.array(reg.name, lid).reshape(-1, pnb)
                assert (rows[others] == untouched).all(), (reg.name, lid)


def test_offering_foreign_or_duplicate_pages_is_refused() -> None:
    with engine_pair(num_pages=8) as (p, d):
        rv = d.agent.receiver(room(), peer=p.address)
        with pytest.raises(ConfigError, match="page ids must be in"):
            rv.init([0, 1, 99], SEQ)
        with pytest.raises(ConfigError, match="appears twice"):
            rv.init([0, 1, 1], SEQ)
        rv.abort("test over")


def test_largest_legit_control_message_fits_the_default_limit() -> None:
    glm = preset("glm-5.3")
    pages = (1 << 20) // glm.page_size_tokens  # a 1M-token context: 16,384 pages of 64
    assert pages == 16384
    req = P.TransferRequest(
        src="127.0.0.1:65535", gen=2**62 - 1, room=2**63 - 1, xfer=2**24 - 1,
        peer_gen=2**62 - 1, seq_len=1 << 20, decode_prefix_len=0, page_size=64,
        dst_pages={reg.name: list(range(10**6, 10**6 + pages)) for reg in glm.regions},
        lease_s=10.0)
    size = len(msgspec.msgpack.encode(req))
    limit = Settings().max_message_bytes
    assert size < limit / 4, (size, limit)
    assert not P.decode(P.encode(req), max_bytes=limit) != req


def test_default_bind_addresses_are_loopback() -> None:
    st = Settings()
    assert st.host == "127.0.0.1" and st.agent_host == "127.0.0.1"
    e = Engine("prefill", preset("glm-5.3", page_size_tokens=16).without_page_rules(), 1,
               fast_settings())
    try:
        assert e.address.startswith("127.0.0.1:")
    finally:
        e.close()
