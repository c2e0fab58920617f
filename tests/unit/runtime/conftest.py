"""Two real agents in one process over the in-process transport (control on real ZMQ sockets
on 127.0.0.1, port 0).

`pair(...)` builds a prefill and a decode agent with their own page pools and buffers; the
prefill buffers hold the deterministic pattern of `kvhandoff.engine_sim`, decode's cached-prefix
indexer pages a marker, so a test checks byte-exactness and untouched prefixes without seeing
the other side's memory.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.pool import PagePool
from kvhandoff.engine_sim.pattern import PREFIX_MARKER, check_tokens, write_tokens
from kvhandoff.kv_layout import LayoutSpec, SendFrom, page_aligned
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.settings import Settings
from kvhandoff.testing.faults import from_config
from kvhandoff.transfer import Receiver, Sender, TransferAgent
from kvhandoff.transports.base import load_transport

WAIT_S = 15.0  # bound of every wait; a healthy run takes milliseconds
SEED = 3


def tiny_layout(*, page_size: int = 16, indexer: tuple[int, ...] = (0, 3, 5)) -> LayoutSpec:
    """Six layers of fp8_ds_mla main KV, a suffix-only indexer on a non-contiguous subset."""
    # small pages on purpose (no attention kernel reads them): the MLA kernel page rules,
    # which the agent enforces at start, are dropped
    return mla_dsa_layout(model="tiny", num_layers=6, indexer_layer_ids=indexer,
                          page_size_tokens=page_size).without_page_rules()


def layers_of(layout: LayoutSpec) -> list[int]:
    return sorted({lid for reg in layout.regions for lid in reg.layer_ids})


@dataclass
class Releases:
    """Counts on_release calls per room and frees the room's pages (once: PagePool raises on a
    double free)."""

    pool: PagePool
    calls: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def callback(self, pages: np.ndarray) -> Callable[[int], None]:
        return functools.partial(self._release, pages)

    def _release(self, pages: np.ndarray, room: int) -> None:
        with self.lock:
            self.calls[room] = self.calls.get(room, 0) + 1
        self.pool.free(pages)


@dataclass
class Side:
    agent: TransferAgent
    pool: PagePool
    releases: Releases

    @property
    def layout(self) -> LayoutSpec:
        return self.agent.layout


@dataclass
class Pair:
    prefill: Side
    decode: Side

    def open(self, room: int, seq_len: int, prefix: int = 0, *, decode_pages: Any = None,
             ready: tuple[int, ...] = ()) -> tuple[Sender, Receiver, np.ndarray, np.ndarray]:
        """Opens `room` on both sides: prefill pages written with the pattern, decode prefix
        indexer pages marked, receiver initialised with the prefill as its peer. Layers in
        `ready` are marked ready on the prefill before the receiver exists (so the prefill
        has them when the decode's request comes)."""
        p, d = self.prefill, self.decode
        ps_p, ps_d = p.layout.page_size_tokens, d.layout.page_size_tokens
        src = p.pool.alloc(-(-seq_len // ps_p))
        for ri, reg in enumerate(p.layout.regions):
            for lid in reg.layer_ids:
                write_tokens(p.agent.buffers.array(reg.name, lid), p.layout, ri, lid, src, 0,
                             seq_len, SEED)
        sender = p.agent.sender(room, pages=src, seq_len=seq_len,
                                on_release=p.releases.callback(src))
        for lid in ready:
            sender.layer_ready(lid)
        dst = d.pool.alloc(-(-seq_len // ps_d)) if decode_pages is None else decode_pages
        cached = page_aligned(prefix, ps_d) // ps_d
        for reg in d.layout.regions:
            if reg.send_from is SendFrom.DECODE_PREFIX and cached:
                for lid in reg.layer_ids:
                    view = d.agent.buffers.array(reg.name, lid).reshape(-1, reg.page_nbytes(ps_d))
                    view[dst[:cached]] = PREFIX_MARKER
        receiver = d.agent.receiver(room, peer=p.agent.address,
                                    on_release=d.releases.callback(dst))
        receiver.init(dst, seq_len, prefix)
        return sender, receiver, src, dst

    def verify(self, dst: np.ndarray, seq_len: int, prefix: int) -> tuple[int, int]:
        """(bytes that differ from the pattern, prefix indexer bytes the handoff touched)."""
        d = self.decode
        ps = d.layout.page_size_tokens
        first_sfx = page_aligned(prefix, ps)
        bad = touched = 0
        for ri, reg in enumerate(d.layout.regions):
            first = first_sfx if reg.send_from is SendFrom.DECODE_PREFIX else 0
            for lid in reg.layer_ids:
                buf = d.agent.buffers.array(reg.name, lid)
                bad += check_tokens(buf, d.layout, ri, lid, dst[first // ps:], first, seq_len,
                                    SEED)
                if first:
                    view = buf.reshape(-1, reg.page_nbytes(ps))
                    touched += int(np.count_nonzero(view[dst[:first // ps]] != PREFIX_MARKER))
        return bad, touched


def _side(role: str, layout: LayoutSpec, settings: Settings, num_pages: int, seed: int,
          faults: dict[str, Any] | None) -> Side:
    pool = PagePool(num_pages, seed=seed)
    kw = from_config(faults, load_transport(settings.transport, settings)) if faults else {}
    agent = TransferAgent(role, layout, allocate(layout, num_pages), settings,
                          engine_id=f"unit-{role}", **kw)
    return Side(agent=agent, pool=pool, releases=Releases(pool))


@pytest.fixture
def pair() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(layout: LayoutSpec | None = None, *, decode_layout: LayoutSpec | None = None,
             num_pages: int = 32, prefill_settings: dict[str, Any] | None = None,
             decode_settings: dict[str, Any] | None = None,
             prefill_faults: dict[str, Any] | None = None,
             decode_faults: dict[str, Any] | None = None, **common: Any) -> Pair:
        """Faults: a `kvhandoff.testing.faults.from_config` dict per side."""
        lp = layout or tiny_layout()
        # heartbeats of 1 s: the pair runs in the test process, and on a loaded host a pause of
        # the whole process (a generation-2 collection took 3.4 s under load) longer than two
        # heartbeats makes each agent declare itself unresponsive and give its rooms up
        base = {"transport": "inproc", "heartbeat_interval_s": 1.0, **common}
        p = _side("prefill", lp, Settings(**{**base, **(prefill_settings or {})}), num_pages, 1,
                  prefill_faults)
        try:
            d = _side("decode", decode_layout or lp,
                      Settings(**{**base, **(decode_settings or {})}), num_pages, 2,
                      decode_faults)
        except BaseException:
            p.agent.close()
            raise
        made.append(Pair(p, d))
        return made[-1]

    yield make
    for pr in made:
        pr.decode.agent.close()
        pr.prefill.agent.close()
