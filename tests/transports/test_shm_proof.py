"""The shm transport writes only into memory a proved peer offered (transports/shm/proof.py).

An address is what a Hello carries, so a peer can declare any pid and ident. Here forged
addresses name a third process holding a canary buffer, the writer's own process, and a real
transport's ident with another pid; forged descriptors name the canary and the writer's own
memory. Each is refused, no byte is written (`bytes_sent` stays 0) and the canaries are
untouched. A peer whose process proves itself connects and is written as before, including a
buffer it registered after the connect. The auto transport sends a same-host peer that proves
nothing over its cross-host part, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport
from kvhandoff.transports.auto import AutoAddress, decode_address
from kvhandoff.transports.base import WriteResult
from kvhandoff.transports.hostid import host_id
from kvhandoff.transports.shm.proof import PeerNotProven
from kvhandoff.transports.shm.transport import ShmTransport
from kvhandoff.transports.shm.wire import _DESC, _DESC_MAGIC, MAGIC, PID, split_address

N = 4096
HERE = Path(__file__).parent


class Canary:
    """A process of its own with a canary buffer (canary_proc.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "canary_proc.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.pid, self.addr, self.nbytes = info["pid"], info["addr"], info["nbytes"]

    def untouched(self) -> bool:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return bool(json.loads(self.proc.stdout.readline())["untouched"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def canary() -> Iterator[Canary]:
    c = Canary()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def writer() -> Iterator[ShmTransport]:
    tr = ShmTransport(Settings(stall_timeout_s=5.0))
    tr.register("kv", np.full(N, 0x5A, dtype=np.uint8))
    try:
        yield tr
    finally:
        tr.close()


def forged(pid: int, ident: bytes, endpoint_of: ShmTransport) -> bytes:
    """An shm address declaring `pid` and `ident` (the endpoint of a real transport)."""
    endpoint = split_address(endpoint_of.address)[2]
    return MAGIC + host_id() + PID.pack(pid) + f"{endpoint}/{ident.decode()}".encode()


def descriptor(pid: int, addr: int, nbytes: int) -> bytes:
    return _DESC.pack(_DESC_MAGIC, pid, -1, 0, 0, addr, nbytes)


def write(tr: ShmTransport, peer: str, remote: str) -> BaseException | None:
    plan = pair_spans(np.array([0]), np.array([N]), np.array([0]), np.array([N]))
    got: list[BaseException | None] = []
    done = threading.Event()

    def on_done(result: WriteResult) -> None:
        got.append(result.error)
        done.set()

    tr.post_writes(peer, [(1, "kv", remote, plan)], on_done)
    assert done.wait(10)
    return got[0]


def test_a_forged_pid_or_ident_is_refused_and_nothing_is_written(
        writer: ShmTransport, canary: Canary) -> None:
    honest = ShmTransport(Settings())
    try:
        own_ident = split_address(writer.address)[3]
        honest_ident = split_address(honest.address)[3]
        stranger = uuid.uuid4().hex.encode()
        cases = {
            "the canary's pid, an ident nobody listens as": (canary.pid, stranger, "listens"),
            "the writer's own pid and ident": (os.getpid(), own_ident, "own"),
            "the writer's own pid, an ident nobody listens as": (os.getpid(), stranger,
                                                                 "listens"),
            "a real transport's ident, the canary's pid": (canary.pid, honest_ident,
                                                           f"is {os.getpid()}"),
        }
        for name, (pid, ident, why) in cases.items():
            with pytest.raises(PeerNotProven, match=why):
                writer.connect(name, forged(pid, ident, honest))
            with pytest.raises(TransportError, match="not connected"):
                writer.register_remote(name, "in", descriptor(pid, canary.addr, N))
        st = writer.status()
        assert st.bytes_sent == 0
        assert f"{len(cases)} peer connection(s) refused" in st.reason
        assert canary.untouched()
    finally:
        honest.close()


def test_a_proved_peer_cannot_aim_writes_outside_its_own_buffers(
        writer: ShmTransport, canary: Canary) -> None:
    peer = ShmTransport(Settings())
    own_canary = np.full(N, 0xC3, dtype=np.uint8)  # memory of the writer's own process
    try:
        peer.register("in", np.zeros(N, dtype=np.uint8))
        writer.connect("peer", peer.address)  # the peer is this process: proved as such
        bad = {
            "the canary process": descriptor(canary.pid, canary.addr, N),
            "the writer's own memory": descriptor(os.getpid(), int(own_canary.ctypes.data), N),
            "a buffer larger than the peer's": descriptor(
                os.getpid(), int(peer._table.buffers["in"].ctypes.data), 1 << 30),
        }
        for name, desc in bad.items():
            with pytest.raises(TransportError, match="vouch|is of process"):
                writer.register_remote("peer", name, desc)
        assert writer.status().bytes_sent == 0
        assert (own_canary == 0xC3).all() and canary.untouched()
        # what the peer really offers is written, byte-exact
        writer.register_remote("peer", "in", peer.describe("in"))
        assert write(writer, "peer", "in") is None
        assert (peer._table.buffers["in"] == 0x5A).all()
        # a buffer registered after the connect: its process is asked again
        late = np.zeros(N, dtype=np.uint8)
        peer.register("late", late)
        writer.register_remote("peer", "late", peer.describe("late"))
        assert write(writer, "peer", "late") is None
        assert (late == 0x5A).all()
    finally:
        writer.disconnect("peer")
        peer.close()


def test_auto_sends_a_peer_that_proves_nothing_cross_host() -> None:
    settings = Settings(auto_cross_host="tcp", stall_timeout_s=5.0)
    a, b = load_transport("auto", settings), load_transport("auto", settings)
    try:
        real = decode_address(b.address)
        shm_host, _, endpoint, _ = split_address(real.shm)
        fake_shm = (MAGIC + shm_host + PID.pack(os.getpid())
                    + f"{endpoint}/{uuid.uuid4().hex}".encode())
        blob = msgspec.msgpack.encode(AutoAddress(real.v, real.host, real.pidns, real.shm_ok,
                                                  real.shm_why, fake_shm, real.cross_kind,
                                                  real.cross))
        a.connect("b", blob)
        assert a.route("b") == "tcp"
        assert "did not prove" in a.status().reason
    finally:
        a.close()
        b.close()
