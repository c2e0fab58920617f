"""The decode's pages are not reused while a one-sided writer may still write into them
(issue 35): real processes, the shm lane (the prefill writes straight into the decode's
pages).

The prefill is a real `kvhandoff.testing.faults` process, the decode an in-process `Engine`
of the test (its release count and pool are read directly). A frozen (SIGSTOP) prefill is a
writer that cannot say it stopped: the decode must hold the pages until it does, or until the
quarantine, never release them at its own abort.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from relkit import WAIT_S, Engine, fast_settings, layers_of

from kvhandoff.engine_sim.process import EngineProcess, spawn
from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import preset
from kvhandoff.protocol.lifecycle import write_quarantine
from kvhandoff.state_machine import KVPoll

OWN_LANES = True  # shm only: the one-sided lane of a host
HB_S = 0.5
SEQ = 128
LAYOUT = preset("glm-5.3", page_size_tokens=64)
LAYERS = layers_of(LAYOUT)
ROOM = 301
PROC_SETTINGS: dict[str, Any] = {"transport": "shm", "heartbeat_interval_s": HB_S,
                                 "lease_s": 5.0}
HELD_S = 1.0  # how long the test checks that the pages stay held while the writer is frozen


def decode_engine(**settings: Any) -> Engine:
    return Engine("decode", LAYOUT, num_pages=4,
                  settings=fast_settings(transport="shm", heartbeat_interval_s=HB_S,
                                         **settings), pattern="sim")


@contextmanager
def prefill_proc(settings: dict[str, Any] | None = None,
                 **cfg: Any) -> Iterator[tuple[EngineProcess, str]]:
    with spawn("prefill", {"rooms": [{"room": ROOM, "seq_len": SEQ}],
                           "settings": {**PROC_SETTINGS, **(settings or {})}, "layer_ms": 30,
                           "timeout_s": WAIT_S, "linger": True, "faults": {}, **cfg},
               module="kvhandoff.testing.faults") as p:
        yield p, p.expect("ready", 60)["address"]


def freeze(p: EngineProcess) -> None:
    p.signal(signal.SIGSTOP)
    _, status = os.waitpid(p.proc.pid, os.WUNTRACED)  # every thread of it stopped
    assert os.WIFSTOPPED(status), status


def test_abort_before_transfer_accepted_holds_pages_while_the_writer_is_frozen() -> None:
    """The prefill accepts and writes at once, but its TransferAccepted never reaches the
    decode (dropped) and one layer's write stays in flight (stalled). The prefill is frozen,
    then the decode's engine aborts: the room fails at once but its pages stay held while the
    writer is frozen (it cannot have stopped); after SIGCONT they come back exactly once."""
    d = decode_engine(stall_timeout_s=2.0, write_quarantine_s=3.0)
    try:
        with prefill_proc(faults={"drop": ["TransferAccepted"],
                                  "stall_layers": [LAYERS[-1]]}) as (p, addr):
            rv = d.recv(ROOM, SEQ, addr)
            p.expect("layer", WAIT_S, layer=LAYERS[3])  # its writes are landing
            # and the decode's TransferRequest (its pages offered) is out: it goes in the step
            # that matched the peer. (On a loaded host the prefill's layer events can come
            # before the handshake; an abort then rightly frees pages nobody could write.)
            until = time.monotonic() + WAIT_S
            while not any(q["matched"] for q in d.agent.status()["peers"]):
                assert time.monotonic() < until, d.agent.status()["peers"]
                time.sleep(0.01)
            freeze(p)
            try:
                rv.abort("engine gave up")
                assert rv.wait(WAIT_S) is KVPoll.Failed
                t_failed = rv.stats()["t_done"]
                # held while the writer is frozen: the window below is the test's look, and a
                # pause of this thread past the product's bound may end it early; the release
                # time checked after SIGCONT is what holds the rule whatever the host does
                if not rv.wait_released(HELD_S):
                    assert d.releases[ROOM] == 0
                    # the id is not opened again before its release (late messages of this use
                    # would reach the new room); the error says why
                    with pytest.raises(ConfigError, match="not released yet"):
                        d.agent.receiver(ROOM, None, peer=addr)
            finally:
                t_cont = time.monotonic()
                p.signal(signal.SIGCONT)
            assert rv.wait_released(WAIT_S)
            # released once the woken writer confirmed it stopped, or (a test thread paused
            # that long) at the quarantine the failure started, never while frozen before it
            bound = write_quarantine(d.agent.settings)
            t_rel = d.released_at[ROOM]
            assert t_rel >= t_cont or t_rel - t_failed >= bound - 0.05, (
                f"pages released {t_rel - t_failed:.2f}s after the failure, the writer frozen "
                f"(quarantine {bound:g}s)")
            assert d.wait_all_released([ROOM], WAIT_S)
            d.assert_no_leak()
            again = d.agent.receiver(ROOM, None, peer=addr)  # released: the id opens
            again.abort("done")
    finally:
        d.close()


def test_a_decode_that_verifies_refuses_a_prefill_that_does_not_sum() -> None:
    """checksum=full on the decode, off on the prefill: the decode verifies only what the
    prefill summed, so this pair used to end in Success with nothing verified. The Hellos now
    carry both modes: both sides fail the room at the handshake, naming both modes."""
    d = decode_engine(checksum="full")
    try:
        with prefill_proc(settings={"checksum": "off"}) as (p, addr):
            rv = d.recv(ROOM, SEQ, addr)
            assert rv.wait(WAIT_S) is KVPoll.Failed
            assert "decode='full'" in (rv.failure or "") and "prefill='off'" in (
                rv.failure or ""), rv.failure
            done = p.expect("done", WAIT_S, room=ROOM)
            assert done["state"] == "Failed", done
            assert d.agent.status()["counters"]["checksums_verified"] == 0
            assert d.wait_all_released([ROOM], WAIT_S)
            d.assert_no_leak()
    finally:
        d.close()


def test_a_frozen_writers_pages_are_held_past_write_quarantine_s_to_its_own_bound() -> None:
    """The prefill is frozen (SIGSTOP) mid-transfer and stays frozen. The decode fails the
    room within two heartbeats; write_quarantine_s (1 s) is shorter than the writer's own
    bound on stopping a copy (stall_timeout_s, 6 s here), so the pages stay held past it and
    come back only after stall_timeout_s + 2 heartbeats, the writer still frozen."""
    d = decode_engine(write_quarantine_s=1.0, stall_timeout_s=6.0)
    try:
        # the prefill holds its later layers until the room ended: frozen mid-transfer
        # however late its layer events reach this test
        # (the prefill's stall bound is the decode's: its Hello says it, and the decode's
        # quarantine outlasts the longer of the two)
        with prefill_proc(settings={"stall_timeout_s": 6.0},
                          hold_after_layer=LAYERS[3]) as (p, addr):
            rv = d.recv(ROOM, SEQ, addr)
            p.expect("layer", WAIT_S, layer=LAYERS[3])
            assert rv.wait_for_layer(LAYERS[0], WAIT_S)  # mid-transfer, the handshake ended
            freeze(p)
            try:
                assert rv.wait(WAIT_S) is KVPoll.Failed
                assert "silent" in (rv.failure or ""), rv.failure
                t_failed = rv.stats()["t_done"]
                assert rv.wait_released(WAIT_S)
                # not at write_quarantine_s (1 s) but at the writer's own bound on stopping a
                # copy, stall_timeout_s + 2 heartbeats after the failure, the writer still
                # frozen (measured from the release, not by a window a paused test can miss)
                held = d.released_at[ROOM] - t_failed
                print(f"frozen writer: pages released {held:.2f}s after the failure")
                assert held >= 6.0 + 2 * HB_S - 0.05, f"released {held:.2f}s after the failure"
                assert d.agent.status()["counters"]["write_quarantines"] == 1
            finally:
                p.signal(signal.SIGCONT)
            assert d.wait_all_released([ROOM], WAIT_S)
            d.assert_no_leak()
    finally:
        d.close()
