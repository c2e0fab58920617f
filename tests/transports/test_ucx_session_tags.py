"""UCX two-sided tags keyed by the control session (issue 48): with a shared secret the agent
binds each peer's data plane to its session key (`Transport.bind_session`), and the UCX tag of
a chunk is an HMAC under a key of that session, not a hash of the sender's address and the
data tag (both public: the address was in the Hello, the tag is a small counter). A chunk
tagged without the session key is not matched by a posted receive; the one tagged with it is.
Two real UCX transports in one process, over UCX's same-host lanes; every wait bounded."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from ondone import Done

from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport

pytest.importorskip("ucxx")

WAIT_S = 20.0
N = 4000  # one chunk, sent eagerly: its send ends without the receiver matching it


@pytest.mark.parametrize("keyed", [True, False])
def test_a_chunk_tagged_without_the_session_key_is_not_matched(keyed: bool) -> None:
    """The receiver is bound to the session key K for the sender. A first send of tag T from
    the sender's own address, but tagged without K (what an off-path process that knows the
    address and T could make), then the real one under K, of other bytes: the receive takes
    the real bytes, never the first. Without a secret (no key bound, `keyed` False) both
    sides tag alike, the first send is the one matched: the receive takes its bytes."""
    st = Settings(ucx_same_host_error_handling=False, stall_timeout_s=WAIT_S)
    a, b = load_transport("ucx", st), load_transport("ucx", st)
    try:
        src = np.zeros(2 * N, np.uint8)
        src[N:] = np.frombuffer(secrets.token_bytes(N), np.uint8)
        src[:N] = 0x5A  # the stranger's bytes
        dst = np.zeros(N, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        key = secrets.token_bytes(32) if keyed else b""
        b.bind_session("a", key)
        a.connect("b", b.address)
        b.connect("a", a.address)
        tag = 1234
        recv = Done()
        b.post_recv("a", tag, "kv", np.array([0]), np.array([N]), recv)
        forged = Done()  # a's address, tag T, no key: its tags are the addresses' hash
        a.post_send("b", tag, "kv", np.array([0]), np.array([N]), forged)
        assert forged.event.wait(WAIT_S) and forged.err is None  # sent (eager)
        a.cancel("b", tag)
        a.bind_session("b", key)  # the real sender of the session
        real = Done()
        a.post_send("b", tag + 0, "kv", np.array([N]), np.array([N]), real)
        assert recv.event.wait(WAIT_S) and recv.err is None, recv.err
        if keyed:
            assert np.array_equal(dst, src[N:]), "the unkeyed chunk was matched"
        else:
            assert np.array_equal(dst, src[:N])  # the first one matched, as before
    finally:
        a.close()
        b.close()
