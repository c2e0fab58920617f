"""IPv6 for the agents' control sockets and the transports' data addresses, in one process.

Real transports and agents on ``[::1]`` (port 0): the addresses they give are in the bracketed
form, two of them move bytes over it, and an IPv6 peer is reached from an IPv4 agent. A host
that is not this machine's is refused at start naming agent_host, and the refused transport or
agent leaves no thread and no file descriptor behind. The two-process handoffs
over ``::1`` are in tests/loopback/test_handoff.py. Skipped, saying why, without ``::1``.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from ipv6_loopback import needs_ipv6_loopback

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.errors import ConfigError, TransportError
from kvhandoff.kv_layout import preset
from kvhandoff.netaddr import split_zmq_endpoint
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent
from kvhandoff.transports import load_transport
from kvhandoff.transports.nixl.wire import decode_address as nixl_address
from kvhandoff.transports.shm.wire import split_address as shm_address
from kvhandoff.transports.tcp import _split_address as tcp_address

pytestmark = needs_ipv6_loopback

HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None
KINDS = ["tcp", "shm", "ucx", "auto",
         pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl_cu12 is not "
                                                       "installed (the nixl extra)"))]
WAIT_S = 20.0
CALM_HB_S = 2.0  # these tests are not about peer death: a loaded 2-core CI machine misses beats
NOT_HERE = "fd00:6b76:6864::1"  # a unique-local address no interface of a test machine has


def _leftovers() -> tuple[set[int], set[str]]:
    """The idents of this process's live threads, and what its open file descriptors are."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return {t.ident for t in threading.enumerate() if t.ident is not None}, fds


def _assert_nothing_left(before: tuple[set[int], set[str]]) -> None:
    threads, fds = _leftovers()
    new_threads = [t.name for t in threading.enumerate() if t.ident in threads - before[0]]
    assert not new_threads, f"threads left by the refused constructor: {new_threads}"
    # a closed ZMQ socket's eventfd is freed by libzmq's reaper thread, after close() returned
    # (the agents share zmq.Context.instance(), which is never terminated): a full run once
    # saw it still open, and a run beside a busy loop on every core two sockets after 5 s.
    # Wait for it (bounded); a descriptor really left stays and fails.
    deadline = time.monotonic() + 30.0
    tick = threading.Event()
    while fds - before[1] and time.monotonic() < deadline:
        tick.wait(0.01)
        fds = _leftovers()[1]
    assert not fds - before[1], f"file descriptors left: {sorted(fds - before[1])}"


def _endpoint(kind: str, address: bytes) -> str | None:
    """The tcp:// endpoint inside a transport's address (None: the address names no host)."""
    if kind == "tcp":
        return tcp_address(address)[0]
    if kind == "shm":
        return shm_address(address)[2]
    if kind == "nixl":
        return tcp_address(nixl_address(address).tcp)[0]
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_transport_pair_on_ipv6_loopback_moves_bytes(kind: str) -> None:
    s = Settings(agent_host="::1", chunk_bytes=64 << 10, stall_timeout_s=WAIT_S)
    a, b = load_transport(kind, s), load_transport(kind, s)
    try:
        ep = _endpoint(kind, a.address)
        if ep is not None:
            assert ep.startswith("tcp://[::1]:"), ep
            assert split_zmq_endpoint(ep)[0] == "::1"
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", b.address)
        b.connect("a", a.address)
        off = np.array([0, 300_000], np.int64)
        nb = np.array([200_000, 500_000], np.int64)
        sent, got = threading.Event(), threading.Event()
        errors: list[BaseException | None] = []

        def done(ev: threading.Event) -> Callable[[BaseException | None], None]:
            def cb(exc: BaseException | None) -> None:
                errors.append(exc)
                ev.set()
            return cb

        b.post_recv("a", 9, "kv", off, nb, done(got))
        a.post_send("b", 9, "kv", off, nb, done(sent))
        assert sent.wait(WAIT_S) and got.wait(WAIT_S), "the transfer did not end in time"
        assert errors == [None, None]
        for o, n in zip(off.tolist(), nb.tolist(), strict=True):
            assert np.array_equal(dst[o:o + n], src[o:o + n])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_transport_refuses_a_host_that_is_not_here(kind: str) -> None:
    load_transport(kind, Settings(agent_host="::1")).close()  # imports done, lazy state made
    before = _leftovers()
    with pytest.raises(TransportError, match=rf"agent_host='{NOT_HERE}'"):
        load_transport(kind, Settings(agent_host=NOT_HERE))
    _assert_nothing_left(before)


def hand_off(pa: TransferAgent, da: TransferAgent, room: int) -> None:
    """One 100-token room from `pa` to `da`, the decode given the prefill's address."""
    sender = pa.sender(room, pages=np.arange(2), seq_len=100)
    receiver = da.receiver(room, peer=pa.address)
    receiver.init(np.arange(2) + 4, 100, 0)
    for layer in range(pa.layout.num_layers):
        sender.layer_ready(layer)
    assert receiver.wait(WAIT_S) is KVPoll.Success
    assert sender.wait(WAIT_S) is KVPoll.Success


def test_agent_control_address_is_bracketed_and_handoff_works() -> None:
    spec = preset("glm-5.3")
    with TransferAgent("prefill", spec, allocate(spec, 8),
                       Settings(transport="tcp", agent_host="::1", agent_metrics_port=0,
                                heartbeat_interval_s=CALM_HB_S)) as pa, \
            TransferAgent("decode", spec, allocate(spec, 8),
                          Settings(transport="tcp", agent_host="[::1]",
                                   heartbeat_interval_s=CALM_HB_S)) as da:
        assert pa.address.startswith("[::1]:") and da.address.startswith("[::1]:")
        assert pa.metrics_address is not None and pa.metrics_address.startswith("[::1]:")
        hand_off(pa, da, 1)


def test_ipv4_agent_reaches_an_ipv6_peer() -> None:
    # each socket's IPV6 option follows the host it binds or connects, not the agent's own
    spec = preset("glm-5.3")
    with TransferAgent("prefill", spec, allocate(spec, 8),
                       Settings(transport="inproc", agent_host="::1",
                                heartbeat_interval_s=CALM_HB_S)) as pa, \
            TransferAgent("decode", spec, allocate(spec, 8),
                          Settings(transport="inproc", heartbeat_interval_s=CALM_HB_S)) as da:
        assert da.address.startswith("127.0.0.1:")
        hand_off(pa, da, 2)


def test_agent_refuses_a_control_host_that_is_not_here() -> None:
    spec = preset("glm-5.3")
    TransferAgent("prefill", spec, allocate(spec, 2), Settings(transport="inproc")).close()
    before = _leftovers()
    with pytest.raises(ConfigError, match=rf"agent_host='{NOT_HERE}'.*cannot bind"):
        TransferAgent("prefill", spec, allocate(spec, 2),  # a secret: past the auth check
                      Settings(transport="inproc", agent_host=NOT_HERE, hmac_secret="k" * 32))
    _assert_nothing_left(before)


@pytest.mark.parametrize("peer", ["::1:7000", "[::1]", "[::1]:0", ""])
def test_receiver_refuses_a_peer_address_naming_the_field(peer: str) -> None:
    spec = preset("glm-5.3")
    with TransferAgent("decode", spec, allocate(spec, 2), Settings(transport="inproc")) as da:
        with pytest.raises(ConfigError, match=r"^peer: expected an agent address"):
            da.receiver(3, peer=peer)
