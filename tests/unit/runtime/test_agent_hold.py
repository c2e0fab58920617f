"""Two real agents (in-process transport, control on real ZMQ sockets): a decode that has a
request queued holds the prefill's room (`TransferAgent.hold_rooms`), which then outlives the
prefill's bootstrap bound and moves byte-exact once the decode opens its receiver; the prefill
counts each renewal (``holds_renewed``). The control room (no hold) fails at the bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvhandoff.engine_sim.pattern import write_tokens
from kvhandoff.state_machine import KVPoll

from .conftest import SEED, Pair, layers_of

BOUND = 1.0  # bootstrap_timeout_s
WAIT_S = 30.0
SEQ = 40


def _counter(agent: Any, name: str) -> int:
    return int(agent.status()["counters"].get(name, 0))


def _until(pred: Callable[[], bool], bound_s: float = WAIT_S) -> bool:
    end = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_a_held_room_outlives_the_bound_and_moves(pair: Callable[..., Pair]) -> None:
    pr = pair(bootstrap_timeout_s=BOUND)
    lay = pr.prefill.layout
    # a first room: the decode and the prefill have a handshake (as under a backlog)
    s1, r1, _src, dst1 = pr.open(1, SEQ, ready=tuple(layers_of(lay)))
    assert r1.wait(WAIT_S) is KVPoll.Success and s1.wait(WAIT_S) is KVPoll.Success
    assert pr.verify(dst1, SEQ, 0)[0] == 0
    # the prefill finished rooms 2 (held by the decode) and 3 (nobody holds it)
    pages: dict[int, Any] = {}
    senders: dict[int, Any] = {}
    for room in (2, 3):
        src = pr.prefill.pool.alloc(-(-SEQ // lay.page_size_tokens))
        pages[room] = src
        senders[room] = pr.prefill.agent.sender(room, pages=src, seq_len=SEQ)
    t_open = time.monotonic()
    pr.decode.agent.hold_rooms(pr.prefill.agent.address, [2])
    # the control room fails at its bound; the held one is still waiting past it
    assert senders[3].wait(WAIT_S) is KVPoll.Failed
    assert "bootstrap deadline expired" in (senders[3].failure or "")
    assert _until(lambda: time.monotonic() - t_open > 2 * BOUND
                  and _counter(pr.prefill.agent, "holds_renewed") >= 3)
    assert senders[2].poll() is KVPoll.Bootstrapping, senders[2].failure
    # the decode schedules the request: its receiver opens (the hold ends), the room moves
    for ri, reg in enumerate(lay.regions):
        for lid in reg.layer_ids:
            write_tokens(pr.prefill.agent.buffers.array(reg.name, lid), lay, ri, lid,
                         pages[2], 0, SEQ, SEED)
    dst = pr.decode.pool.alloc(-(-SEQ // pr.decode.layout.page_size_tokens))
    r2 = pr.decode.agent.receiver(2, peer=pr.prefill.agent.address)
    r2.init(dst, SEQ, 0)
    for lid in layers_of(lay):
        senders[2].layer_ready(lid)
    assert r2.wait(WAIT_S) is KVPoll.Success, r2.failure
    assert senders[2].wait(WAIT_S) is KVPoll.Success
    assert pr.verify(dst, SEQ, 0)[0] == 0
    assert _counter(pr.prefill.agent, "holds_expired") == 0
