"""GPU tests (marker `gpu`; skipped with "no CUDA device" without one): two transfer agents in
two processes, both with CUDA buffers, over the shm transport's CUDA IPC lane.

- A whole room: the prefill (child) writes every layer one-sided into the decode's (this
  process's) CUDA pages, marked ready behind CUDA events; both sides use the device checksum
  (devsum), the decode verifies every layer, every byte matches the pattern, the lane is
  shm/cuda-ipc.
- The writer survives a decode that dies: this process is the prefill, holding the child
  decode's memory open through IPC; the child kills itself once the first layer landed; the
  room fails here, this process's CUDA context still works, the agent closes.

Run by scripts/gpu_check.sh (`pytest -m gpu`). Written without a GPU at hand: not run yet."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.protocol.effects import Effect, HashSpans, PostWrite
from kvhandoff.runtime.seam import Filtered
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

from .shm_cuda_agent_peer import bad_bytes, fill, layers_of, tiny_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PEER = Path(__file__).with_name("shm_cuda_agent_peer.py")
WAIT_S = 60.0
SEQ, NUM_PAGES, SEED, ROOM = 200, 32, 5, 77


class Child:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.send(cfg)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the child exited (rc {self.proc.poll()}) without answering"
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for c in made:
        c.close()


def _pages(seed: int) -> np.ndarray:
    n = -(-SEQ // tiny_layout().page_size_tokens)
    return np.random.default_rng(seed).permutation(NUM_PAGES)[:n].astype(np.int64)


class _Recorder:
    """An effect filter (`protocol.effects.EffectFilter`) that keeps a copy of every effect
    and lets it through."""

    def __init__(self, into: list[Effect]) -> None:
        self.into = into

    def __call__(self, eff: Effect, now: float) -> Iterable[Effect]:
        self.into.append(eff)
        return (eff,)

    def due(self, now: float) -> Iterable[Effect]:
        return ()

    def next_due(self) -> float | None:
        return None


def test_two_agents_hand_off_cuda_memory_over_shm(children: list[Child]) -> None:
    layout = tiny_layout()
    src_pages, dst_pages = _pages(1), _pages(2)
    child = Child({"role": "prefill", "room": ROOM, "seq": SEQ, "num_pages": NUM_PAGES,
                   "pages": src_pages.tolist(), "seed": SEED, "die_after": -1})
    children.append(child)
    prefill_addr = child.read()["address"]
    bufs = allocate(layout, NUM_PAGES, device="cuda")
    agent = TransferAgent("decode", layout, bufs,
                          Settings(transport="shm", heartbeat_interval_s=0.2),
                          engine_id="gpu-decode")
    seen: list[Effect] = []
    agent._loop.install(lambda step: Filtered(step, _Recorder(seen)))
    try:
        assert agent.buffers.memory == "cuda"
        receiver = agent.receiver(ROOM, peer=prefill_addr)
        receiver.init(dst_pages, SEQ, 0)
        state = receiver.wait(WAIT_S)
        assert state is KVPoll.Success, receiver.failure
        stats = receiver.stats()
        assert stats["one_sided"] is True and stats["checksums_verified"] > 0
        assert bad_bytes(bufs, layout, dst_pages, SEQ, SEED) == 0
        verifies = [e for e in seen if isinstance(e, HashSpans)]
        assert verifies and {e.alg for e in verifies} == {"devsum"}
        assert not [e for e in seen if isinstance(e, PostWrite)]  # the decode writes nothing
        theirs = child.read()
        assert theirs["state"] == "Success" and theirs["one_sided"] is True
        assert "shm/cuda-ipc" in theirs["lanes"]
    finally:
        agent.close()


def test_the_writer_survives_a_decode_that_dies(children: list[Child]) -> None:
    layout = tiny_layout()
    src_pages, dst_pages = _pages(3), _pages(4)
    bufs = allocate(layout, NUM_PAGES, device="cuda")
    fill(bufs, layout, src_pages, SEQ, SEED)
    torch.cuda.synchronize()
    agent = TransferAgent("prefill", layout, bufs,
                          Settings(transport="shm", heartbeat_interval_s=0.2),
                          engine_id="gpu-prefill")
    try:
        sender = agent.sender(ROOM, pages=src_pages, seq_len=SEQ)
        child = Child({"role": "decode", "room": ROOM, "seq": SEQ, "num_pages": NUM_PAGES,
                       "pages": dst_pages.tolist(), "seed": SEED, "die_after": 0})
        children.append(child)
        child.read()  # its address: it connects to us
        child.send({"peer": agent.address})
        lids = layers_of(layout)
        ev = torch.cuda.Event()
        ev.record()
        sender.layer_ready(lids[0], ev)
        child.proc.wait(WAIT_S)  # it kills itself once layer 0 landed
        assert child.proc.returncode == -9
        for lid in lids[1:]:  # writes into a dead process: refused, never launched
            ev = torch.cuda.Event()
            ev.record()
            sender.layer_ready(lid, ev)
        state = sender.wait(WAIT_S)
        assert state is KVPoll.Failed, state
        # this process's CUDA context is intact
        x = torch.ones(1 << 20, device="cuda")
        assert int(x.sum().item()) == 1 << 20
        torch.cuda.synchronize()
    finally:
        agent.close()
