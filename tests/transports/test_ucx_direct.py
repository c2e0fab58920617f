"""UCX receives straight into user memory (direct chunks) end before their op does: a receive
that fails part way (one chunk's size mismatch or error) reports its end only once none of
its other chunks is still being written into the caller's memory, so the caller (the agent:
the room's release) never reuses memory UCX is still writing. Two real UCX transports over
UCX's same-host lanes, in one process and with the sender in a second process
(peer_proc.py); every wait bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvhandoff.errors import TransportError
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport

CHUNK = 8 << 20  # large chunks: each direct receive takes a while to land
WAIT_S = 20.0
PEER = Path(__file__).with_name("peer_proc.py")


class Snapshot:
    """An on_done that copies the receive buffer the moment the op says it ended."""

    def __init__(self, dst: np.ndarray) -> None:
        self.dst = dst
        self.event = threading.Event()
        self.err: BaseException | None = None
        self.copy: np.ndarray | None = None
        self.calls = 0

    def __call__(self, exc: BaseException | None) -> None:
        self.calls += 1
        self.err = exc
        self.copy = self.dst.copy()
        self.event.set()


@pytest.mark.parametrize("trial", range(5))
def test_a_receive_that_fails_part_way_ends_after_its_direct_chunks_landed(trial: int) -> None:
    """The receive expects 4 chunks; the sender's stream has 3 full ones and a short fourth:
    chunks 0-2 are received straight into the buffer while chunk 3's size mismatch fails the
    receive. Nothing may land in the buffer after its on_done."""
    st = Settings(chunk_bytes=CHUNK, stall_timeout_s=WAIT_S, ucx_same_host_error_handling=False)
    a, b = load_transport("ucx", st), load_transport("ucx", st)
    try:
        src = np.random.default_rng(trial).integers(0, 255, 4 * CHUNK, dtype=np.uint8)
        dst = np.full(4 * CHUNK, 0xFF, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", b.address)
        b.connect("a", a.address)
        got = Snapshot(dst)
        sent = threading.Event()
        b.post_recv("a", 5, "kv", np.array([0]), np.array([4 * CHUNK]), got)
        a.post_send("b", 5, "kv", np.array([0]), np.array([3 * CHUNK + CHUNK // 2]),
                    lambda exc: sent.set())
        assert got.event.wait(WAIT_S), "the receive never ended"
        assert isinstance(got.err, TransportError) and "size mismatch" in str(got.err)
        a.cancel("b", 5)  # the send ends either way
        assert sent.wait(WAIT_S)
        b.close()  # whatever UCX still had in flight has ended once close returns
        assert got.calls == 1 and got.copy is not None
        changed = int(np.count_nonzero(got.copy != dst))
        assert changed == 0, f"{changed} bytes landed after the receive said it ended"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("trial", range(3))
def test_the_same_with_the_sender_in_another_process(trial: int) -> None:
    st = Settings(chunk_bytes=CHUNK, stall_timeout_s=WAIT_S, ucx_same_host_error_handling=False)
    b = load_transport("ucx", st)
    proc = subprocess.Popen([sys.executable, str(PEER), "ucx", str(CHUNK), str(4 * CHUNK),
                             str(trial)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def say(**msg: object) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()

    def expect(key: str) -> dict[str, object]:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends (EOF) if the process dies: then the assert below
            msg = json.loads(line)
            if key in msg:
                return dict(msg)
        raise AssertionError(f"peer process ended without {key!r}")

    try:
        dst = np.full(4 * CHUNK, 0xFF, np.uint8)
        b.register("kv", dst)
        b.connect("peer", bytes.fromhex(str(expect("address")["address"])))
        say(cmd="connect", address=b.address.hex())
        expect("connected")
        got = Snapshot(dst)
        b.post_recv("peer", 5, "kv", np.array([0]), np.array([4 * CHUNK]), got)
        say(cmd="send", tag=5, offsets=[0], nbytes=[3 * CHUNK + CHUNK // 2])
        assert got.event.wait(WAIT_S), "the receive never ended"
        assert isinstance(got.err, TransportError) and "size mismatch" in str(got.err)
        say(cmd="exit")  # its send ends, it closes and exits
        expect("closed")
        assert proc.wait(timeout=WAIT_S) == 0
        b.close()
        assert got.calls == 1 and got.copy is not None
        changed = int(np.count_nonzero(got.copy != dst))
        assert changed == 0, f"{changed} bytes landed after the receive said it ended"
    finally:
        b.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
