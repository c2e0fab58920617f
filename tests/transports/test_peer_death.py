"""A receiver process killed mid-write does not take the writer with it (shm, both lanes).

The writer is this process; the receiver a real second process (peer_proc.py) receiving into
plain memory (lane shm/cma: process_vm_writev, a dead peer is ESRCH) or into a kvhandoff shared
segment (lane shm/map: the writer maps it; the mapping outlives the peer). The write is made
of many small pieces, with one copy thread and one iovec per syscall, so it lasts long enough
to be killed in the middle; the test kills once a copy thread started it. Then the
writer's send fails with a reason, the writer keeps running, new ops to the dead peer fail
at once, and a new peer works.

A frozen (SIGSTOPped) writer: the receiver's cancel() / disconnect() return without waiting on
it; the receive's on_done comes once the writer confirmed it stopped (after SIGCONT), or its
process is gone, or stall_timeout_s passed (with a warning).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from test_conformance import BUF, CHUNK, PEER, WAIT_S, Done, PeerProcess

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout import pair_spans
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport
from kvhandoff.transports.base import WriteResult
from kvhandoff.transports.shm import copy as _shm_copy
from kvhandoff.transports.shm.transport import ShmTransport
from kvhandoff.transports.shm.wire import parse_descriptor

SIZE = 64 << 20
PIECE = 256


class BigPeer(PeerProcess):
    """peer_proc.py with a SIZE-byte receive buffer."""

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), kind, str(1 << 20), str(SIZE),
                                      "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.held: list[dict[str, object]] = []
        threading.Thread(target=self._read, daemon=True).start()


@pytest.mark.parametrize("kind", ["shm", "shm-map"])
def test_receiver_killed_mid_write(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm_copy, "IOV_MAX", 1)  # one piece per syscall: a long write
    started = threading.Event()
    copy_part = _shm_copy._copy_part

    def copy_part_started(*args: Any) -> Any:
        started.set()
        return copy_part(*args)

    monkeypatch.setattr(_shm_copy, "_copy_part", copy_part_started)
    peer = BigPeer(kind)
    tr = ShmTransport(Settings(chunk_bytes=1 << 20, stall_timeout_s=WAIT_S), copy_threads=1)
    try:
        src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        tr.register("kv", src)
        tr.connect("peer", bytes.fromhex(str(peer.expect("address")["address"])))
        peer.send(cmd="connect", address=tr.address.hex())
        peer.expect("connected")
        n = SIZE // PIECE
        off = np.random.default_rng(2).permutation(n).astype(np.int64) * PIECE
        ds = Done()
        tr.post_send("peer", 1, "kv", off, np.full(n, PIECE, np.int64), ds)
        peer.send(cmd="recv", tag=1, offsets=[0], nbytes=[SIZE])
        peer.expect("posted")
        assert started.wait(WAIT_S), "the copy into the peer never started"
        peer.proc.send_signal(signal.SIGKILL)
        assert peer.proc.wait(WAIT_S) == -signal.SIGKILL
        err = ds.wait()
        assert isinstance(err, TransportError), "the write into a dead peer did not fail"
        assert "exited" in str(err) or "No such process" in str(err), err
        assert tr.peer_exited("peer")  # what the agent asks before it drops the peer
        lane = "shm/map" if kind == "shm-map" else "shm/cma"
        st = tr.status()
        assert st.lanes == (lane,) and "gone" in st.reason
        late = Done()  # an op to the dead peer ends at once, with the reason
        tr.post_send("peer", 2, "kv", np.array([0]), np.array([10]), late)
        err = late.wait()
        assert isinstance(err, TransportError) and "exited" in str(err)
        tr.disconnect("peer")  # returns: nothing to wait for from a dead process
        # the writer still works: a new peer, a new transfer
        other = ShmTransport(Settings(chunk_bytes=1 << 20))
        try:
            dst = np.zeros(1000, np.uint8)
            other.register("kv", dst)
            tr.connect("other", other.address)
            other.connect("me", tr.address)
            ds, dr = Done(), Done()
            other.post_recv("me", 3, "kv", np.array([0]), np.array([1000]), dr)
            tr.post_send("other", 3, "kv", np.array([0]), np.array([1000]), ds)
            assert dr.wait() is None and ds.wait() is None
            assert np.array_equal(dst, src[:1000])
        finally:
            other.close()
    finally:
        tr.close()
        if peer.proc.poll() is None:
            peer.proc.kill()


@pytest.mark.parametrize("then", ["sigcont", "sigkill", "bound"])
@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_shm_stopped_writer_holds_the_receive_not_the_caller(
        how: str, then: str, caplog: pytest.LogCaptureFixture) -> None:
    """The peer process was told about our receive (it may write into it) and is frozen:
    cancel() / disconnect() return at once, on_done waits for the writer (or its exit, or
    the bound), exactly once, with the reason."""
    peer = PeerProcess("shm", 5)
    bound = 1.0 if then == "bound" else 120.0
    tr = ShmTransport(Settings(chunk_bytes=CHUNK, stall_timeout_s=bound))
    stopped = False
    try:
        tr.register("kv", np.zeros(BUF, np.uint8))
        tr.connect("peer", bytes.fromhex(str(peer.expect("address")["address"])))
        peer.send(cmd="connect", address=tr.address.hex())
        peer.expect("connected")
        held = Done()  # the peer never sends tag 1: its receive stays exposed
        tr.post_recv("peer", 1, "kv", np.array([0]), np.array([BUF // 2]), held)
        # tag 2's R leaves after tag 1's on the same socket: once tag 2 landed, the peer has
        # tag 1's R too (it may write into that memory)
        dr = Done()
        tr.post_recv("peer", 2, "kv", np.array([BUF // 2]), np.array([1000]), dr)
        peer.send(cmd="send", tag=2, offsets=[0], nbytes=[1000])
        assert dr.wait() is None
        peer.proc.send_signal(signal.SIGSTOP)
        stopped = True
        _, status = os.waitpid(peer.proc.pid, os.WUNTRACED)  # every thread of it stopped
        assert os.WIFSTOPPED(status), status
        with caplog.at_level(logging.WARNING, logger="kvhandoff.transports.shm.transport"):
            if how == "cancel":
                tr.cancel("peer", 1)  # returns: it never waits on the frozen peer
            else:
                tr.disconnect("peer")
            if then != "bound":  # (the bound is far: nothing can have released it)
                assert not held.event.is_set(), "on_done came while the writer may still write"
                assert "held until their writer confirms" in tr.status().reason
            if how == "cancel":
                assert not tr.peer_exited("peer")  # stopped is not gone
            if then == "sigcont":
                peer.proc.send_signal(signal.SIGCONT)
                stopped = False
            elif then == "sigkill":
                peer.proc.send_signal(signal.SIGKILL)
                assert peer.proc.wait(WAIT_S) == -signal.SIGKILL
            err = held.wait()
        word = "cancelled" if how == "cancel" else "disconnected"
        assert isinstance(err, TransportError) and word in str(err), err
        warned = [r for r in caplog.records if "did not confirm" in r.getMessage()]
        assert bool(warned) == (then == "bound"), [r.getMessage() for r in caplog.records]
        assert "held until" not in tr.status().reason
        if then == "sigcont" and how == "cancel":  # the link still works
            again = Done()
            tr.post_recv("peer", 3, "kv", np.array([0]), np.array([1000]), again)
            peer.send(cmd="send", tag=3, offsets=[0], nbytes=[1000])
            assert again.wait() is None
    finally:
        if stopped and peer.proc.poll() is None:
            peer.proc.send_signal(signal.SIGCONT)
        tr.close()
        if peer.proc.poll() is None:
            peer.close()


def test_shm_write_cancel_with_frozen_receiver_stops_before_return(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-sided write into a frozen peer's shared segment: cancel() returns (the copy is
    local: it never waits on the peer), and when it returns no copy of that write runs and
    nothing more of it lands; its on_done says cancelled."""
    monkeypatch.setattr(_shm_copy, "IOV_MAX", 2)  # 2 MiB per foreign call: a few ms each
    started = threading.Event()
    running = [0]
    copy_part = _shm_copy._copy_part

    def copy_part_counted(*args: Any) -> Any:
        running[0] += 1
        started.set()
        try:
            return copy_part(*args)
        finally:
            running[0] -= 1

    monkeypatch.setattr(_shm_copy, "_copy_part", copy_part_counted)
    peer = BigPeer("shm-map")
    tr = ShmTransport(Settings(chunk_bytes=1 << 20, stall_timeout_s=WAIT_S), copy_threads=1)
    stopped = False
    try:
        src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        tr.register("kv", src)
        tr.connect("peer", bytes.fromhex(str(peer.expect("address")["address"])))
        peer.send(cmd="connect", address=tr.address.hex())
        peer.expect("connected")
        desc = bytes.fromhex(str(peer.ask("describe")["descriptor"]))
        tr.register_remote("peer", "in", desc)
        pid, fd, seg_n, seg_off, _, nbytes = parse_descriptor(desc)
        # the peer's memory, seen from here (the test looks through /proc; the transport maps
        # the memfd the peer handed it)
        memfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            mapping = _shm_copy._map_segment(memfd, seg_n)
        finally:
            os.close(memfd)
        assert mapping is not None and nbytes == SIZE
        theirs = np.frombuffer(mapping, np.uint8)[seg_off:seg_off + SIZE]
        peer.proc.send_signal(signal.SIGSTOP)
        stopped = True
        _, status = os.waitpid(peer.proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        piece = 1 << 20
        n = SIZE // piece
        off = np.random.default_rng(2).permutation(n).astype(np.int64) * piece
        results: list[BaseException | None] = []
        written = threading.Event()

        def on_written(result: WriteResult) -> None:
            results.append(result.error)
            written.set()

        tr.post_writes("peer", [(1, "kv", "in",
                                 pair_spans(off, np.full(n, piece, np.int64), np.array([0]),
                                            np.array([SIZE])))], on_written)
        assert started.wait(WAIT_S), "the write never started"
        tr.cancel("peer", 1)
        assert running[0] == 0, "a copy of the write still runs after cancel() returned"
        snapshot = theirs.copy()
        assert written.wait(WAIT_S) and len(results) == 1
        err = results[0]
        if err is None:  # it completed before cancel: then all of it landed
            assert np.array_equal(theirs, np.concatenate([src[o:o + piece] for o in off]))
        else:
            assert isinstance(err, TransportError) and "cancelled" in str(err), err
        assert np.array_equal(theirs, snapshot), "the write went on after cancel() returned"
        del theirs
        mapping.close()
    finally:
        if stopped and peer.proc.poll() is None:
            peer.proc.send_signal(signal.SIGCONT)
        tr.close()
        if peer.proc.poll() is None:
            peer.close()


def test_ucx_sender_killed_mid_receive_with_error_handling() -> None:
    """ucx with peer error handling (ucx_same_host_error_handling): the sender process dies
    while a receive is in flight; disconnect() returns (it does not wait for a request from a
    dead peer), the receive ends with an error and the receiver keeps running. Closing the
    endpoint UCX had failed crashed this process with SIGSEGV inside ucxx before."""
    env_var = "KVHANDOFF_UCX_SAME_HOST_ERROR_HANDLING"
    peer = BigPeer("ucx", env={env_var: "true"})
    tr = load_transport("ucx", Settings(chunk_bytes=1 << 20, stall_timeout_s=WAIT_S,
                                        ucx_same_host_error_handling=True))
    try:
        buf = np.zeros(SIZE, np.uint8)
        tr.register("kv", buf)
        tr.connect("peer", bytes.fromhex(str(peer.expect("address")["address"])))
        peer.send(cmd="connect", address=tr.address.hex())
        peer.expect("connected")
        dr = Done()
        tr.post_recv("peer", 1, "kv", np.array([0]), np.array([SIZE]), dr)
        peer.send(cmd="send", tag=1, offsets=[0], nbytes=[SIZE])
        peer.expect("posted")
        peer.proc.send_signal(signal.SIGKILL)
        assert peer.proc.wait(WAIT_S) == -signal.SIGKILL
        tr.disconnect("peer")  # what the agent does once heartbeats say the peer is gone
        err = dr.wait()
        assert isinstance(err, TransportError)
    finally:
        tr.close()
        if peer.proc.poll() is None:
            peer.proc.kill()
