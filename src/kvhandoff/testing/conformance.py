"""A transport conformance kit: the checks any `Transport` must pass, for kvhandoff's own
transports and for one a user writes (as trio's `check_two_way_stream`).

How it works: each check gets a factory that builds one fresh, unconnected transport (the same
settings on both sides) and builds two of them: `a` writes from its buffer, `b` receives into
its own; both registered under "kv", connected to each other as peers "a" and "b". A check
moves real bytes over the transport's real lanes, with every wait bounded by `wait_s`, and
raises `ConformanceError` (an AssertionError) naming the check and what went wrong. It closes
what it built, pass or fail.

The checks (`CHECKS`, in this order):
- register_and_connect: a buffer name is taken once, a non-uint8 buffer is refused naming it,
  connect is idempotent for the same address, a post to an unknown peer is refused.
- two_sided: random span lists of one total, cut differently on each side, byte exact in
  both post orders, nothing outside the receive's spans touched; an empty list completes.
- one_sided: only for a `OneSidedTransport` (else skipped): describe / register_remote, a
  random `SpanPlan` written with checksum=True lands byte exact, its digest the xxh3-64 of
  the source stream.
- cancel: a cancelled receive ends with "cancelled" and nothing of a later send lands in it;
  the link still carries the next transfer.
- disconnect: pending ops of that peer fail, a later post to it is refused ("not
  connected"), nothing lands.
- dead_peer: the peer transport closes while a send to it is pending: disconnect() returns
  (never waits on the peer) and the send ends within the bound (a TransportError, or done
  when the peer's transport had taken the bytes before it closed).

`run_conformance(factory)` runs them all and returns {check name: "passed" or "skipped: why"}.
Rules: public (tests/transports runs it against every kvhandoff transport; docs/TRANSFER.md
says how to run it against another); no pytest import; no sleeps, only bounded waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import pair_spans
from kvhandoff.transports.base import OneSidedTransport, Transport, WriteResult

TransportFactory = Callable[[], Transport]
BufferFactory = Callable[[int], np.ndarray]

__all__ = ["CHECKS", "ConformanceError", "Options", "run_check", "run_conformance"]


class ConformanceError(AssertionError):
    """A transport failed a conformance check (the message names the check)."""


class Skip(Exception):  # noqa: N818 - a check that does not apply, not an error
    """The check does not apply to this transport."""


@dataclass(frozen=True)
class Options:
    """What the checks may assume: `buffer_bytes` per side (at least 64 KiB), `make_buffer`
    (a zeroed 1-D uint8 array of that size: e.g. one in a shared segment), `wait_s` per wait,
    `seed` of the random spans."""

    buffer_bytes: int = 1 << 20
    make_buffer: BufferFactory = lambda n: np.zeros(n, np.uint8)  # noqa: E731
    wait_s: float = 20.0
    seed: int = 1


class _Done:
    """An on_done that records its results and sets an event."""

    def __init__(self, wait_s: float) -> None:
        self.event = threading.Event()
        self.results: list[tuple[object, ...]] = []
        self._wait_s = wait_s

    def __call__(self, *result: object) -> None:
        self.results.append(result)
        self.event.set()

    def wait(self, what: str) -> tuple[object, ...]:
        _check(self.event.wait(self._wait_s), f"{what}: on_done not called within "
                                              f"{self._wait_s} s")
        _check(len(self.results) == 1, f"{what}: on_done called {len(self.results)} times")
        return self.results[0]

    def error(self, what: str) -> object:
        return self.wait(what)[0]


@dataclass
class _Pair:
    a: Transport
    b: Transport
    src: np.ndarray
    dst: np.ndarray
    opts: Options

    def done(self) -> _Done:
        return _Done(self.opts.wait_s)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConformanceError(message)


@contextmanager
def _pair(make: TransportFactory, opts: Options) -> Iterator[_Pair]:
    a = make()
    try:
        b = make()
    except BaseException:
        a.close()
        raise
    try:
        src, dst = opts.make_buffer(opts.buffer_bytes), opts.make_buffer(opts.buffer_bytes)
        src[:] = np.random.default_rng(opts.seed).integers(0, 256, src.size, dtype=np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        a.connect("b", b.address)
        b.connect("a", a.address)
        yield _Pair(a, b, src, dst, opts)
    finally:
        a.close()
        b.close()


def random_spans(rng: np.random.Generator, total: int, buf_bytes: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`total` bytes cut at random places, the spans scattered over a `buf_bytes` buffer in a
    random order with random gaps (neighbours rarely contiguous)."""
    cuts = np.unique(rng.integers(1, max(total, 2), size=int(rng.integers(1, 64))))
    bounds = np.concatenate([[0], cuts[cuts < total], [total]]).astype(np.int64)
    nb = np.diff(bounds)
    gaps = rng.multinomial(buf_bytes - total, np.ones(nb.size + 1) / (nb.size + 1))[:-1]
    perm = rng.permutation(nb.size)
    laid = nb[perm] + gaps
    off = np.empty_like(nb)
    off[perm] = np.concatenate([[0], np.cumsum(laid)[:-1]]) + gaps
    return off, nb


def stream(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> bytes:
    """The bytes of a span list, in order."""
    return b"".join(buf[o:o + n].tobytes() for o, n in zip(off.tolist(), nb.tolist(),
                                                             strict=True))


def _outside(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> bool:
    """Whether any byte outside the spans is nonzero."""
    mask = np.ones(buf.size, bool)
    for o, n in zip(off.tolist(), nb.tolist(), strict=True):
        mask[o:o + n] = False
    return bool(buf[mask].any())


def _transfer(p: _Pair, tag: int, s: tuple[np.ndarray, np.ndarray],
              d: tuple[np.ndarray, np.ndarray], send_first: bool) -> tuple[_Done, _Done]:
    ds, dr = p.done(), p.done()
    if send_first:
        p.a.post_send("b", tag, "kv", *s, ds)
        p.b.post_recv("a", tag, "kv", *d, dr)
    else:
        p.b.post_recv("a", tag, "kv", *d, dr)
        p.a.post_send("b", tag, "kv", *s, ds)
    return ds, dr


def _marker(p: _Pair, tag: int, what: str) -> None:
    """A small transfer into the buffer's last 100 bytes that must complete."""
    n = p.opts.buffer_bytes
    ds, dr = _transfer(p, tag, (np.array([0]), np.array([100])),
                       (np.array([n - 100]), np.array([100])), True)
    _check(dr.error(f"{what}: the next receive") is None and
           ds.error(f"{what}: the next send") is None, f"{what}: the link no longer works")
    _check(bool(np.array_equal(p.dst[n - 100:], p.src[:100])),
           f"{what}: the next transfer is not byte exact")


# ---- the checks -------------------------------------------------------------------------------

def check_register_and_connect(make: TransportFactory, opts: Options) -> None:
    with _pair(make, opts) as p:
        refusals: list[tuple[Callable[[], object], str]] = [
            (lambda: p.a.register("kv", np.zeros(8, np.uint8)), "a name registered twice"),
            (lambda: p.a.register("f", np.zeros(8, np.float32)), "a float32 buffer"),
            (lambda: p.a.post_send("nobody", 1, "kv", np.array([0]), np.array([1]), p.done()),
             "a post to an unknown peer")]
        for bad, why in refusals:
            try:
                bad()
            except TransportError:
                continue
            raise ConformanceError(f"register_and_connect: {why} was not refused with "
                                   "TransportError")
        p.a.connect("b", p.b.address)  # the same address again: no-op
        _marker(p, 2, "register_and_connect")


def check_two_sided(make: TransportFactory, opts: Options) -> None:
    rng = np.random.default_rng(opts.seed)
    with _pair(make, opts) as p:
        for tag, send_first in ((11, True), (12, False)):
            p.dst[:] = 0
            total = int(rng.integers(1, opts.buffer_bytes // 2))
            s = random_spans(rng, total, opts.buffer_bytes)
            d = random_spans(rng, total, opts.buffer_bytes)
            ds, dr = _transfer(p, tag, s, d, send_first)
            order = "send first" if send_first else "receive first"
            _check(dr.error(f"two_sided ({order}): receive") is None,
                   f"two_sided ({order}): the receive failed: {dr.results}")
            _check(ds.error(f"two_sided ({order}): send") is None,
                   f"two_sided ({order}): the send failed: {ds.results}")
            _check(stream(p.dst, *d) == stream(p.src, *s),
                   f"two_sided ({order}): the landed bytes differ from the sent ones")
            _check(not _outside(p.dst, *d),
                   f"two_sided ({order}): bytes outside the receive's spans were written")
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        ds, dr = _transfer(p, 13, empty, empty, True)
        _check(ds.error("two_sided: empty send") is None and
               dr.error("two_sided: empty receive") is None,
               "two_sided: an empty span list did not complete cleanly")


def check_one_sided(make: TransportFactory, opts: Options) -> None:
    with _pair(make, opts) as p:
        a, b = p.a, p.b
        if not isinstance(a, OneSidedTransport) or not isinstance(b, OneSidedTransport):
            raise Skip(f"the {a.kind} transport has no one-sided writes")
        rng = np.random.default_rng(opts.seed + 1)
        total = int(rng.integers(1, opts.buffer_bytes // 2))
        s = random_spans(rng, total, opts.buffer_bytes)
        d = random_spans(rng, total, opts.buffer_bytes)
        a.register_remote("b", "kv", b.describe("kv"))
        w = p.done()
        a.post_writes("b", [(21, "kv", "kv", pair_spans(*s, *d))], w, checksum=True)
        result = w.wait("one_sided: write")[0]
        _check(isinstance(result, WriteResult) and len(result.digests) == 1,
               f"one_sided: on_done got {result!r}, not a WriteResult of one write")
        assert isinstance(result, WriteResult)
        err, digest = result.error, result.digests[0]
        _check(err is None, f"one_sided: the write failed: {err}")
        _check(stream(p.dst, *d) == stream(p.src, *s),
               "one_sided: the landed bytes differ from the written ones")
        _check(not _outside(p.dst, *d), "one_sided: bytes outside the plan were written")
        want = xxhash.xxh3_64_intdigest(stream(p.src, *s))
        _check(digest == want, f"one_sided: digest {digest} is not the xxh3-64 of the source "
                               f"stream ({want})")


def check_cancel(make: TransportFactory, opts: Options) -> None:
    with _pair(make, opts) as p:
        n = opts.buffer_bytes // 2
        dr = p.done()
        p.b.post_recv("a", 31, "kv", np.array([0]), np.array([n]), dr)
        p.b.cancel("a", 31)
        err = dr.error("cancel: the cancelled receive")
        _check(isinstance(err, TransportError) and "cancelled" in str(err),
               f"cancel: the cancelled receive ended with {err!r}, not a 'cancelled' "
               "TransportError")
        ds = p.done()
        p.a.post_send("b", 31, "kv", np.array([0]), np.array([n]), ds)
        _marker(p, 32, "cancel")
        p.a.cancel("b", 31)
        ds.wait("cancel: the send into the cancelled receive")  # ends one way or the other
        p.b.cancel("a", 999)  # nothing pending: harmless
        _check(not p.dst[:n].any(), "cancel: bytes landed in a cancelled receive")


def check_disconnect(make: TransportFactory, opts: Options) -> None:
    with _pair(make, opts) as p:
        dr, ds = p.done(), p.done()
        p.b.post_recv("a", 41, "kv", np.array([0]), np.array([1000]), dr)
        # large enough that no transport completes it before the peer receives
        p.a.post_send("b", 42, "kv", np.array([0]), np.array([opts.buffer_bytes // 2]), ds)
        p.b.disconnect("a")
        err = dr.error("disconnect: the pending receive")
        _check(isinstance(err, TransportError),
               f"disconnect: the pending receive ended with {err!r}, not a TransportError")
        p.a.disconnect("b")
        err = ds.error("disconnect: the pending send")
        _check(isinstance(err, TransportError),
               f"disconnect: the pending send ended with {err!r}, not a TransportError")
        try:
            p.a.post_send("b", 43, "kv", np.array([0]), np.array([10]), p.done())
        except TransportError as e:
            _check("not connected" in str(e), f"disconnect: the refusal says {e}, not 'not "
                                              "connected'")
        else:
            raise ConformanceError("disconnect: a post to a disconnected peer was accepted")
        _check(not p.dst.any(), "disconnect: bytes landed")


def check_dead_peer(make: TransportFactory, opts: Options) -> None:
    with _pair(make, opts) as p:
        ds = p.done()
        p.a.post_send("b", 51, "kv", np.array([0]), np.array([opts.buffer_bytes // 2]), ds)
        p.b.close()  # the peer is gone (its process would be dead: nothing answers)
        done = threading.Event()

        def drop() -> None:
            p.a.disconnect("b")
            done.set()

        threading.Thread(target=drop, daemon=True, name="kvhandoff-conformance-drop").start()
        _check(done.wait(opts.wait_s), f"dead_peer: disconnect() did not return within "
                                       f"{opts.wait_s} s (it waited on the dead peer)")
        # it ends within the bound, never hangs: with an error, or done when the peer's
        # transport took the bytes before it closed (UCX may hold an unexpected message)
        err = ds.error("dead_peer: the pending send")
        _check(err is None or isinstance(err, TransportError),
               f"dead_peer: the send to the dead peer ended with {err!r}, not a "
               "TransportError")


CHECKS: dict[str, Callable[[TransportFactory, Options], None]] = {
    "register_and_connect": check_register_and_connect,
    "two_sided": check_two_sided,
    "one_sided": check_one_sided,
    "cancel": check_cancel,
    "disconnect": check_disconnect,
    "dead_peer": check_dead_peer,
}


def run_check(name: str, make: TransportFactory, opts: Options | None = None) -> str:
    """Runs check `name`; "passed", or "skipped: why" when it does not apply.

    Raises:
        ConformanceError: the transport failed it.
        KeyError: no such check.
    """
    try:
        CHECKS[name](make, opts or Options())
    except Skip as e:
        return f"skipped: {e}"
    return "passed"


def run_conformance(make: TransportFactory, opts: Options | None = None) -> dict[str, str]:
    """Runs every check (see module docstring); raises ConformanceError at the first failure."""
    return {name: run_check(name, make, opts) for name in CHECKS}
