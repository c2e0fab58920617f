"""One side of a cross-host handoff as a long-lived process, driven by JSON lines on stdin.

Usage: python xagent.py prefill|decode '<json config>'. The process holds one real
`TransferAgent` (its settings from the config) over a small GLM-5.3-shaped layout
(`LAYERS` layers, fp8_ds_mla main KV and a suffix-only indexer), pools its pages and serves
rooms one command at a time, so a test can fault the network under a room and then hand the
next room over between the same two processes. Page contents are `kvhandoff.engine_sim`'s
deterministic pattern, so the decode checks every landed byte without seeing the prefill.

Commands (one JSON object a line on stdin), answered by events (one a line on stdout):
- ``{"cmd": "send", "room": r, "seq_len": n, "layer_ms": ms, "hold_after_layer": l}``
  (prefill): writes the pattern, opens the sender, marks a layer ready every `layer_ms`; with
  `hold_after_layer` (optional), after marking layer `l` it waits until the room ended, and
  marks the later layers only if it is still open (a fault then lands mid-transfer however
  late the test acts); events ``layer`` (each layer handed over) and ``done`` (state,
  failure, released, stats).
- ``{"cmd": "recv", "room": r, "seq_len": n, "prefix": p}`` (decode): opens the receiver
  through the bootstrap server, offers pages; events ``layer`` (landed and verified) and
  ``done`` (state, failure, released, bad_bytes of the landed tokens, prefix_touched: bytes
  of the cached prefix's pages, marked before, that changed).
- ``{"cmd": "rooms", "count": n}`` (prefill, which shares the bootstrap server's network):
  allocates n rooms and binds them to this engine, ``rooms`` (their ids).
- ``{"cmd": "status"}``: ``status`` (the agent's rooms by state, peers, transport lanes,
  counters, the free pages of the pool).
- end of stdin: the agent closes, ``closed``.
Every wait inside is bounded (`timeout_s` of the config).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from typing import Any

import numpy as np

from kvhandoff.buffers.pool import PagePool
from kvhandoff.engine_sim.pattern import PREFIX_MARKER, check_tokens, write_tokens
from kvhandoff.kv_layout import SendFrom, page_aligned
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

LAYERS = 8
INDEXER_LAYERS = (1, 4, 7)
PAGE = 16
POOL_PAGES = 512  # 8,192 tokens: a few rooms at once
_out_lock = threading.Lock()


def emit(kind: str, **fields: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps({"event": kind, "t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()


def layout() -> Any:
    return mla_dsa_layout(model="glm-5.3-xhost", num_layers=LAYERS,
                          indexer_layer_ids=INDEXER_LAYERS, page_size_tokens=PAGE
                          ).without_page_rules()


class Side:
    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        self.role = role
        self.cfg = cfg
        self.spec = layout()
        self.layers = sorted({lid for reg in self.spec.regions for lid in reg.layer_ids})
        self.settings = Settings(**cfg["settings"])
        self.timeout_s = float(cfg.get("timeout_s", 30))
        self.seed = int(cfg.get("seed", 7))
        self.pool = PagePool(POOL_PAGES, seed=self.seed + (role == "decode"))
        self.pool_lock = threading.Lock()
        # numpy buffers (the agent takes them as it takes torch tensors): no torch import,
        # which is half of a process start; filled with 0xFF, a byte the pattern never has
        bufs = {reg.name: {lid: np.full(reg.page_nbytes(PAGE) * POOL_PAGES, 0xFF, np.uint8)
                           for lid in reg.layer_ids} for reg in self.spec.regions}
        self.agent = TransferAgent(role, self.spec, bufs, self.settings,
                                   engine_id=cfg.get("engine_id", role))

    def _alloc(self, seq_len: int) -> Any:
        with self.pool_lock:
            return self.pool.alloc(-(-seq_len // PAGE))

    def _free(self, pages: Any, room: int) -> None:
        with self.pool_lock:
            self.pool.free(pages)

    def send(self, room: int, seq_len: int, layer_ms: float,
             hold_after_layer: int | None = None) -> None:
        pages = self._alloc(seq_len)
        for ri, reg in enumerate(self.spec.regions):
            for lid in reg.layer_ids:
                write_tokens(self.agent.buffers.array(reg.name, lid), self.spec, ri, lid, pages,
                             0, seq_len, self.seed)
        s = self.agent.sender(room, pages=pages, seq_len=seq_len,
                              on_release=functools.partial(self._free, pages))
        tick = threading.Event()  # never set: a bounded pause standing for a layer's compute
        for lid in self.layers:
            if layer_ms:
                tick.wait(layer_ms / 1e3)
            s.layer_ready(lid)
            emit("layer", room=room, layer=lid)
            if lid == hold_after_layer and s.wait(self.timeout_s) in (KVPoll.Failed,
                                                                      KVPoll.Success):
                break
        state = s.wait(self.timeout_s)
        stats = s.stats()  # before the room can be forgotten
        released = s.wait_released(self.timeout_s)
        emit("done", room=room, state=state.name, failure=s.failure, released=released,
             t_released=time.monotonic(), stats=stats)

    def recv(self, room: int, seq_len: int, prefix: int) -> None:
        from kvhandoff.errors import KVHandoffError

        pages = self._alloc(seq_len)
        cached = page_aligned(prefix, PAGE) // PAGE  # pages of the prefix this side holds
        for reg in self.spec.regions:
            if reg.send_from is SendFrom.DECODE_PREFIX:
                for lid in reg.layer_ids:
                    view = self.agent.buffers.array(reg.name, lid).reshape(
                        -1, reg.page_nbytes(PAGE))
                    view[pages[:cached]] = PREFIX_MARKER
        rv = self.agent.receiver(room, self.settings.bootstrap_url,
                                 on_release=functools.partial(self._free, pages))
        rv.init(pages, seq_len, prefix)
        for lid in self.layers:
            try:
                rv.wait_for_layer(lid, self.timeout_s)
            except KVHandoffError:
                break  # failed or timed out: "done" says which
            emit("layer", room=room, layer=lid)
        state = rv.wait(self.timeout_s)
        stats = rv.stats()  # before the room can be forgotten
        released = rv.wait_released(self.timeout_s)
        t_released = time.monotonic()
        bad = touched = None
        if state.name == "Success":
            # (one room at a time per test: nothing reuses the pages before this check)
            first_cached = page_aligned(prefix, PAGE)
            bad = touched = 0
            for ri, reg in enumerate(self.spec.regions):
                first = first_cached if reg.send_from is SendFrom.DECODE_PREFIX else 0
                for lid in reg.layer_ids:
                    bad += check_tokens(self.agent.buffers.array(reg.name, lid), self.spec, ri,
                                        lid, pages[first // PAGE:], first, seq_len, self.seed)
                    if first:  # the cached prefix must keep its marker
                        view = self.agent.buffers.array(reg.name, lid).reshape(
                            -1, reg.page_nbytes(PAGE))
                        touched += int(np.count_nonzero(
                            view[pages[:cached]] != PREFIX_MARKER))
        emit("done", room=room, state=state.name, failure=rv.failure, released=released,
             bad_bytes=bad, prefix_touched=touched, t_released=t_released, stats=stats)

    def rooms(self, count: int) -> None:
        """Allocates `count` rooms at the bootstrap server and binds them to this engine."""
        from kvhandoff.bootstrap_server.client import BootstrapClient

        self.agent.wait_registered(self.timeout_s)
        with BootstrapClient.from_settings(self.settings) as c:
            ids = c.allocate_rooms(count)
            for room in ids:
                c.bind_room(room, self.agent.engine_id, 0)
        emit("rooms", rooms=ids)

    def status(self) -> None:
        st = self.agent.status()
        with self.pool_lock:
            free = self.pool.free_count
        emit("status", rooms=st["rooms"], peers=st["peers"], transport=st["transport"],
             counters=st["counters"], free_pages=free, total_pages=POOL_PAGES)


def main() -> int:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    import logging

    logging.basicConfig(level=cfg.get("log_level", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    side = Side(role, cfg)
    emit("ready", address=side.agent.address, host=__import__("socket").gethostname())
    workers: list[threading.Thread] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "status":
            side.status()
            continue
        if cmd == "rooms":
            side.rooms(int(msg.get("count", 1)))
            continue
        if cmd == "send":
            target: Any = functools.partial(side.send, int(msg["room"]), int(msg["seq_len"]),
                                            float(msg.get("layer_ms", 0)),
                                            msg.get("hold_after_layer"))
        elif cmd == "recv":
            target = functools.partial(side.recv, int(msg["room"]), int(msg["seq_len"]),
                                       int(msg.get("prefix", 0)))
        else:
            emit("error", error=f"unknown command {cmd!r}")
            continue
        t = threading.Thread(target=target, daemon=True)
        t.start()
        workers.append(t)
    for t in workers:
        t.join(side.timeout_s * 3)
    side.agent.close()
    emit("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
