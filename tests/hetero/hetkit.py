"""Helpers of the heterogeneous-topology tests (issue 8): many real agents in one process over
the in-process transport (control on real ZMQ sockets on 127.0.0.1, port 0).

A `Rank` is one engine rank: a real `TransferAgent` with its own buffers and shuffled page pool.
`handoff(...)` runs one room across a prefill engine of several ranks and a decode engine of
several ranks: every prefill rank writes the deterministic pattern of `kvhandoff.engine_sim` (salted
per plane name, so a head or key/scale mix-up shows), every decode rank marks its cached-prefix
indexer pages, reads from the prefill ranks the TP mapping of the bootstrap server names, and
is then checked byte by byte against the pattern. Every wait is bounded; nothing sleeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks
from kvhandoff.buffers.pool import PagePool
from kvhandoff.engine_sim.pattern import PREFIX_MARKER, check_tokens, write_tokens
from kvhandoff.kv_layout import LayoutSpec, SendFrom, TPSplit, page_aligned
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import Receiver, Sender, TransferAgent

WAIT_S = 20.0  # bound of every wait; a healthy room takes milliseconds
SEED = 11


def settings(**extra: Any) -> Settings:
    # heartbeats of 1 s: dozens of agents share one process on 2 loaded cores; no test here
    # waits on a heartbeat (refusals are messages), so a slow beat only adds robustness
    base: dict[str, Any] = {"transport": "inproc", "heartbeat_interval_s": 1.0,
                            "bootstrap_timeout_s": 120.0}
    return Settings(**{**base, **extra})


def layers_of(layout: LayoutSpec) -> list[int]:
    return sorted({lid for reg in layout.regions for lid in reg.layer_ids})


def is_replicated(layout: LayoutSpec) -> bool:
    return all(r.tp_split is TPSplit.REPLICATED for r in layout.regions)


@dataclass(eq=False)
class Rank:
    """One engine rank: a real agent, its buffers and its page pool."""

    agent: TransferAgent
    pool: PagePool

    @property
    def layout(self) -> LayoutSpec:
        return self.agent.layout

    @property
    def page_size(self) -> int:
        return self.agent.layout.page_size_tokens

    def pages_for(self, seq_len: int) -> np.ndarray:
        return self.pool.alloc(-(-seq_len // self.page_size))

    def close(self) -> None:
        self.agent.close()


def buffers(spec: LayoutSpec, num_pages: int) -> dict[str, dict[int, np.ndarray]]:
    """Zeroed numpy buffers, one per (region, layer) (the agent takes numpy arrays as it takes
    torch tensors; allocating dozens of ranks' buffers with numpy is ~100x cheaper)."""
    ps = spec.page_size_tokens
    return {reg.name: {lid: np.zeros(reg.page_nbytes(ps) * num_pages, dtype=np.uint8)
                       for lid in reg.layer_ids} for reg in spec.regions}


def make_ranks(role: str, layouts: Sequence[LayoutSpec], *, num_pages: int,
               cfg: Settings | None = None, seed: int = 0, shuffle: bool = True) -> list[Rank]:
    """One rank per layout (rank i of len(layouts)), each with `num_pages` pages (handed out in
    random order unless `shuffle` is False)."""
    out = []
    cfg = cfg or settings()
    for i, spec in enumerate(layouts):
        agent = TransferAgent(role, spec, buffers(spec, num_pages), cfg,
                              tp_rank=i, tp_size=len(layouts))
        pool = PagePool(num_pages, seed=seed * 100 + i, shuffle=shuffle)
        out.append(Rank(agent=agent, pool=pool))
    return out


def close_all(ranks: Sequence[Rank]) -> None:
    for r in ranks:
        r.close()


def fill(rank: Rank, pages: np.ndarray, seq_len: int) -> None:
    """Prefill: the salted pattern of tokens [0, seq_len) in every buffer of the rank."""
    spec = rank.layout
    for ri, reg in enumerate(spec.regions):
        for lid in reg.layer_ids:
            write_tokens(rank.agent.buffers.array(reg.name, lid), spec, ri, lid, pages, 0,
                         seq_len, SEED, salt=True)


def _first(reg: Any, prefix: int, page_size: int) -> int:
    return page_aligned(prefix, page_size) if reg.send_from is SendFrom.DECODE_PREFIX else 0


def mark_prefix(rank: Rank, pages: np.ndarray, prefix: int) -> None:
    """Decode: the cached-prefix pages of suffix-only regions hold a marker."""
    spec, ps = rank.layout, rank.page_size
    for reg in spec.regions:
        n = _first(reg, prefix, ps) // ps
        if n:
            for lid in reg.layer_ids:
                view = rank.agent.buffers.array(reg.name, lid).reshape(-1, reg.page_nbytes(ps))
                view[pages[:n]] = PREFIX_MARKER


def verify(rank: Rank, pages: np.ndarray, seq_len: int, prefix: int) -> tuple[int, int]:
    """Decode: (bytes differing from the pattern, cached-prefix bytes that lost the marker)."""
    spec, ps = rank.layout, rank.page_size
    bad = touched = 0
    for ri, reg in enumerate(spec.regions):
        first = _first(reg, prefix, ps)
        for lid in reg.layer_ids:
            buf = rank.agent.buffers.array(reg.name, lid)
            bad += check_tokens(buf, spec, ri, lid, pages[first // ps:], first, seq_len, SEED,
                                salt=True)
            if first:
                view = buf.reshape(-1, reg.page_nbytes(ps))
                touched += int(np.count_nonzero(view[pages[:first // ps]] != PREFIX_MARKER))
    return bad, touched


def one_copy_bytes(layout: LayoutSpec, seq_len: int, prefix: int) -> int:
    """Bytes one decode rank of `layout` needs for a room (its planes; suffix-only regions
    from its page-aligned prefix on)."""
    ps = layout.page_size_tokens
    return sum(reg.bytes_per_token * reg.num_layers * (seq_len - _first(reg, prefix, ps))
               for reg in layout.regions)


@dataclass
class Outcome:
    """What one room across the two engines did."""

    prefill_states: list[KVPoll]
    decode_states: list[KVPoll]
    failures: list[str | None]  # decode ranks' failures
    prefill_failures: list[str | None]
    sources: dict[int, list[int]]  # decode rank -> prefill ranks it was told to read from
    peers: list[list[str]]  # decode rank -> peer addresses of its legs (stats)
    decode_bytes: list[int]
    prefill_bytes: list[int]
    bad: list[int]
    touched: list[int]
    descriptors: list[dict[str, int]]  # decode rank -> region -> descriptors (all layers)
    descriptors_before: list[dict[str, int]]
    released: bool
    pools_full: bool
    stats: list[dict[str, Any]] = field(default_factory=list)


def _release(pool: PagePool, pages: np.ndarray, room: int) -> None:
    pool.free(pages)


def handoff(prefill: Sequence[Rank], decode: Sequence[Rank], room: int, *, seq_len: int,
            prefix: int = 0,
            sources: Callable[[int], list[int]] | None = None) -> Outcome:
    """One room from the prefill ranks to the decode ranks, both sides' TP sizes being the
    lengths of the lists. `sources(d)` picks the prefill ranks of decode rank d (default: the
    bootstrap server's TP mapping, one rank for replicated layouts)."""
    big_p, big_d = len(prefill), len(decode)
    rep = is_replicated(decode[0].layout)
    pick = sources or (lambda d: prefill_tp_ranks(d, big_d, big_p, replicated=rep))
    src = {d: pick(d) for d in range(big_d)}
    senders: list[Sender] = []
    for p, rank in enumerate(prefill):
        n = sum(p in src[d] for d in range(big_d))
        pages = rank.pages_for(seq_len)
        fill(rank, pages, seq_len)
        senders.append(rank.agent.sender(room, pages=pages, seq_len=seq_len, num_decode_ranks=n,
                                         on_release=functools.partial(_release, rank.pool,
                                                                      pages)))
    recvs: list[tuple[Receiver, np.ndarray]] = []
    for d, rank in enumerate(decode):
        pages = rank.pages_for(seq_len)
        mark_prefix(rank, pages, prefix)
        rv = rank.agent.receiver(room, peer=[prefill[p].agent.address for p in src[d]],
                                 on_release=functools.partial(_release, rank.pool, pages))
        rv.init(pages, seq_len, prefix)
        recvs.append((rv, pages))
    for lid in layers_of(prefill[0].layout):
        for s in senders:
            s.layer_ready(lid)
    d_states = [rv.wait(WAIT_S) for rv, _ in recvs]
    p_states = [s.wait(WAIT_S) for s in senders]
    checks = [verify(rank, pages, seq_len, prefix) if st is KVPoll.Success else (-1, -1)
              for rank, (rv, pages), st in zip(decode, recvs, d_states, strict=True)]
    stats = [rv.stats() for rv, _ in recvs]
    released = all(h.wait_released(WAIT_S) for h in [*senders, *(rv for rv, _ in recvs)])
    pools = all(r.pool.free_count == r.pool.num_pages for r in [*prefill, *decode])
    return Outcome(
        prefill_states=p_states, decode_states=d_states,
        failures=[rv.failure for rv, _ in recvs], sources=src,
        prefill_failures=[s.failure for s in senders],
        peers=[st["peers"] for st in stats], decode_bytes=[st["bytes"] for st in stats],
        prefill_bytes=[s.stats()["bytes"] for s in senders],
        bad=[c[0] for c in checks], touched=[c[1] for c in checks],
        descriptors=[st["descriptors"] for st in stats],
        descriptors_before=[st["descriptors_before"] for st in stats],
        released=released, pools_full=pools, stats=stats)
