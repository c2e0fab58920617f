"""Shared parts of the reliability matrix: engines around real agents, and measurements.

`Engine` is a minimal engine around a real `TransferAgent` in the test process: a `PagePool`
(leaks and double frees visible), deterministic page contents (the `kvhandoff.engine_sim` pattern)
and release callbacks that count how often each room's pages were handed back. Two engines
talk over a real transport (tcp sockets or UCX) and real ZMQ control sockets on 127.0.0.1.

Page contents: by default each plane of each region gets its own deterministic pattern (a head
or key/scale mix-up would show); `pattern="sim"` uses `kvhandoff.engine_sim`'s pattern instead, so
an `Engine` can pair with a `kvhandoff.engine_sim` process.

Every wait is bounded; a test asserts states, reasons, counts and bytes, never timings, except
the generous upper bounds the reliability issue asks for (time to Failed, fail-fast).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.buffers.pool import PagePool
from kvhandoff.buffers.shared import allocate_shared
from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import KVHandoffError
from kvhandoff.kv_layout import LayoutSpec, SendFrom, page_aligned
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.testing.faults import from_config
from kvhandoff.testing.patterns import check_pattern, write_pattern
from kvhandoff.transfer import Receiver, Sender, TransferAgent
from kvhandoff.transports.base import load_transport

WAIT_S = 20.0  # bound on any wait for a room that is expected to end


def mini_glm(page_size_tokens: int = 16, num_layers: int = 6,
             indexer_layer_ids: tuple[int, ...] = (1, 5)) -> LayoutSpec:
    """GLM-5.3's byte structure (fp8_ds_mla main KV + two-plane suffix-only indexer on
    non-contiguous layers) with few layers, so hundreds of rooms fit in CI memory."""
    return mla_dsa_layout(model="glm-5.3-mini", num_layers=num_layers,
                          indexer_layer_ids=indexer_layer_ids, page_size_tokens=page_size_tokens
                          ).without_page_rules()  # 16-token pages on purpose: no kernel reads them


#: The transport `fast_settings` gives: the conftest runs each test of the matrix on every
#: lane of LANES (tcp two-sided; shm, where the prefill writes one-sided into the decode)
LANES = ("tcp", "shm")
lane = "tcp"


def fast_settings(**kw: Any) -> Settings:
    """Agent settings with heartbeats of 0.5 s (the default is 2 s): a dead peer shows within
    about a second (at 0.2 s, a loaded host's own pauses of half a second made agents give
    their rooms up; the tests that must outlast a busy host's pauses set 2 s)."""
    base: dict[str, Any] = {"transport": lane, "heartbeat_interval_s": 0.5, "lease_s": 5.0}
    base.update(kw)
    return Settings(**base)


def layers_of(layout: LayoutSpec) -> list[int]:
    return sorted({lid for reg in layout.regions for lid in reg.layer_ids})


class Engine:
    """A real agent plus a page pool and release accounting (one side of a handoff)."""

    def __init__(self, role: str, layout: LayoutSpec, num_pages: int, settings: Settings, *,
                 seed: int = 0, pattern: str = "planes", faults: dict[str, Any] | None = None,
                 shared_pool: bool = False, **agent_kw: Any) -> None:
        """`faults`: a `kvhandoff.testing.faults.from_config` dict (the agent's transport is
        wrapped, its control messages filtered). `shared_pool`: the buffers lie in one
        kvhandoff shared segment (`allocate_shared`), so a same-host writer maps them (shm's
        map lane, where the writer verifies what it wrote); else plain memory (cma lane)."""
        if faults:
            agent_kw.update(from_config(faults, load_transport(settings.transport, settings),
                                        role))
        self.role = role
        self.sim_pattern = pattern == "sim"
        self.layout = layout
        self.seed = seed
        self.pool = PagePool(num_pages, seed=seed + (role == "decode"))
        self.start_free = self.pool.free_count
        # filled (not calloc-zero): every page is resident from the start, so RSS measures
        # growth, not the first touch of pool pages
        self.agent = TransferAgent(role, layout, _pool_buffers(layout, num_pages, shared_pool),
                                   settings, **agent_kw)
        self.releases: Counter[int] = Counter()
        self.released_at: dict[int, float] = {}  # room -> time.monotonic() of its last release
        self.release_errors: list[str] = []
        self.pages: dict[int, np.ndarray] = {}
        self.prefix: dict[int, int] = {}
        self._lock = threading.Lock()
        self.released_event = threading.Condition(self._lock)

    @property
    def address(self) -> str:
        return self.agent.address

    def _on_release(self, pages: np.ndarray) -> Callable[[int], None]:
        def cb(room: int) -> None:
            with self._lock:
                self.releases[room] += 1
                self.released_at[room] = time.monotonic()
                try:
                    self.pool.free(pages)
                except KVHandoffError as e:
                    self.release_errors.append(f"room {room}: {e}")
                self.released_event.notify_all()
        return cb

    def _pages_for(self, room: int, seq_len: int) -> np.ndarray:
        pages = self.pool.alloc(-(-seq_len // self.layout.page_size_tokens))
        self.pages[room] = pages
        return pages

    def send(self, room: int, seq_len: int, *, ready: bool | int = True) -> Sender:
        """Opens a sender with deterministic contents; marks all layers ready (True), none
        (False) or the first `ready` layers (int)."""
        pages = self._pages_for(room, seq_len)
        for ri, reg in enumerate(self.layout.regions):
            for lid in reg.layer_ids:
                buf = self.agent.buffers.array(reg.name, lid)
                if self.sim_pattern:
                    write_tokens(buf, self.layout, ri, lid, pages, 0, seq_len, self.seed)
                else:
                    write_pattern(buf, self.layout, ri, lid, pages, seq_len, self.seed)
        s = self.agent.sender(room, pages=pages, seq_len=seq_len,
                              on_release=self._on_release(pages))
        layers = layers_of(self.layout)
        n = len(layers) if ready is True else int(ready)
        for lid in layers[:n]:
            s.layer_ready(lid)
        return s

    def recv(self, room: int, seq_len: int, peer: str | None, *, prefix: int = 0,
             init: bool = True, bootstrap: str | None = None) -> Receiver:
        """Opens a receiver towards agent `peer` (or, peer=None, through the bootstrap server
        at `bootstrap`) and offers pages for the whole sequence."""
        pages = self._pages_for(room, seq_len)
        self.prefix[room] = page_aligned(prefix, self.layout.page_size_tokens)
        rv = self.agent.receiver(room, bootstrap, peer=peer, on_release=self._on_release(pages))
        if init:
            rv.init(pages, seq_len, prefix)
        return rv

    def bad_bytes(self, room: int, seq_len: int) -> int:
        """Bytes of `room`'s landed tokens that differ from the prefill pattern."""
        pages = self.pages[room]
        ps = self.layout.page_size_tokens
        bad = 0
        for ri, reg in enumerate(self.layout.regions):
            first = self.prefix[room] if reg.send_from is SendFrom.DECODE_PREFIX else 0
            for lid in reg.layer_ids:
                check = check_tokens if self.sim_pattern else check_pattern
                bad += check(self.agent.buffers.array(reg.name, lid), self.layout, ri, lid,
                             pages[first // ps:], first, seq_len, self.seed)
        return bad

    def wait_all_released(self, rooms: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(self.releases[r] for r in rooms):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.released_event.wait(left)
        return True

    def assert_no_leak(self) -> None:
        """Every page back in the pool, every room released exactly once, no double free."""
        assert not self.release_errors, self.release_errors
        twice = {r: n for r, n in self.releases.items() if n != 1}
        assert not twice, f"{self.role}: rooms released more than once: {twice}"
        assert set(self.releases) == set(self.pages), (
            f"{self.role}: rooms never released: {sorted(set(self.pages) - set(self.releases))}")
        assert self.pool.free_count == self.start_free, (
            f"{self.role}: {self.start_free - self.pool.free_count} pages leaked")

    def close(self) -> None:
        self.agent.close()


def _pool_buffers(layout: LayoutSpec, num_pages: int, shared: bool) -> dict[str, Any]:
    """Every page filled (not calloc-zero), in plain memory or one shared segment."""
    if not shared:
        return allocate(layout, num_pages, fill=0xFF)
    bufs = allocate_shared(layout, num_pages)
    for held in bufs.values():
        for buf in held.values() if isinstance(held, dict) else [held]:
            buf.fill_(0xFF)
    return bufs


@contextmanager
def engine_pair(layout: LayoutSpec | None = None, *, num_pages: int = 64,
                settings: Settings | None = None, prefill_settings: Settings | None = None,
                decode_settings: Settings | None = None, decode_layout: LayoutSpec | None = None,
                decode_pages: int | None = None, prefill_faults: dict[str, Any] | None = None,
                decode_faults: dict[str, Any] | None = None,
                decode_shared_pool: bool = False) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode `Engine` (closed at the end), with optional faults per side;
    `decode_shared_pool`: the decode's pages in a shared segment (see `Engine`)."""
    layout = layout or mini_glm()
    base = settings or fast_settings()
    p = Engine("prefill", layout, num_pages, prefill_settings or base, faults=prefill_faults)
    try:
        d = Engine("decode", decode_layout or layout, decode_pages or num_pages,
                   decode_settings or base, faults=decode_faults,
                   shared_pool=decode_shared_pool)
        try:
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


def handoff(p: Engine, d: Engine, room: int, seq_len: int, *, prefix: int = 0
            ) -> tuple[Sender, Receiver]:
    """One complete handoff; returns the handles after both sides ended."""
    s = p.send(room, seq_len)
    rv = d.recv(room, seq_len, p.address, prefix=prefix)
    assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
    assert s.wait(WAIT_S) is KVPoll.Success, s.failure
    return s, rv


def wait_until(pred: Callable[[], bool], timeout: float, poll_s: float = 0.01) -> bool:
    """Polls `pred` until true or `timeout` (for state held by another process or agent that
    exposes no event); returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


@contextmanager
def frozen_control(e: Engine) -> Iterator[None]:
    """The control thread of `e` frozen (a silent peer: no heartbeat, no answer) from when the
    block starts until it ends, bounded by 2 * WAIT_S. The block waits on what the freeze must
    cause (the other side failing the room); the freeze ends right after, not after a fixed
    time that a loaded host can outlast before the other side has looked."""
    held, release = threading.Event(), threading.Event()

    def hold(_: Any) -> None:
        held.set()
        release.wait(2 * WAIT_S)

    t = threading.Thread(target=lambda: e.agent._loop.query(hold, timeout=3 * WAIT_S),
                         name="test-freeze", daemon=True)
    t.start()
    try:
        assert held.wait(WAIT_S), "the control thread never ran the freeze"
        yield
    finally:
        release.set()
        t.join(WAIT_S)


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (Linux /proc). For this process, memory the allocator
    holds free is given back first (glibc malloc_trim), so RSS shows what is in use, not how
    fragmented the heap of a long pytest run is."""
    if pid is None:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: RSS as it is
            pass
    with open(f"/proc/{pid or 'self'}/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class Prober:
    """A raw ZMQ peer of an agent's control socket: a DEALER that sends any frames, and a
    ROUTER of its own (its `address`) where the agent's answers arrive. No agent code on this
    side: frames are built by hand or with `protocol.encode`."""

    def __init__(self, target: str) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://{target}")
        self.gen = int.from_bytes(os.urandom(7), "big") | 1

    def send(self, frames: list[bytes]) -> None:
        self.dealer.send_multipart(frames)

    def recv(self, timeout: float) -> Any:
        """The next message the agent sent to this prober (decoded), or None on timeout."""
        from kvhandoff.protocol import wire as P

        if not self.router.poll(int(timeout * 1000)):
            return None
        frames = self.router.recv_multipart()
        return P.decode(frames[1:], max_bytes=1 << 24)

    def barrier(self, role: str, timeout: float = WAIT_S) -> list[Any]:
        """Sends a Hello the agent must refuse (an unknown transport) and waits for its
        HelloReject: the agent's control loop is alive and has handled every frame this prober
        sent before (one connection delivers in order). Returns every message the agent sent
        to the prober meanwhile, the HelloReject last."""
        from kvhandoff.protocol import wire as P

        hello = P.Hello(src=self.address, gen=self.gen, agent_id="prober", role=role,
                        transport="probe", transport_address=b"", layout={}, layout_hash="",
                        buffers=[])
        self.send(P.encode(hello))
        deadline = time.monotonic() + timeout
        got: list[Any] = []
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"no answer from the agent within {timeout}s"
            got.append(msg)
            if isinstance(msg, P.HelloReject):
                return got

    def close(self) -> None:
        self.dealer.close(0)
        self.router.close(0)

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def age_out_finished_rooms(e: Engine, after_s: float = 3600.0) -> None:
    """Runs the agent's own collection of finished rooms as if `after_s` seconds had passed.
    An agent keeps the record of a finished room for 10 minutes (late messages still find it);
    a soak test cannot wait that long, so it ages them out here, between rounds."""
    e.agent._loop.query(lambda s: s.collect(time.monotonic() + after_s))


def plan_of(e: Engine, room: int, region: str) -> Any:
    """The span plan of `region` of `room`'s first leg on engine `e`, read on the agent's
    control thread (the only thread that touches the session)."""
    return e.agent._loop.query(lambda s: s.rooms.by_id[room].legs[0].plan.chunk_plans[0][region])


def free_port() -> int:
    """A TCP port that was free a moment ago (for servers that must come back on the same
    port after a restart)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
