"""`Hasher`: every checksum the driver computes for its session, off the control thread.

The session asks for sums in two ways, and both end here:
- `HashSpans` (a layer's source spans before `LayerDone`, or its landed spans to verify): the
  sums of each span list with the room's algorithm, on the hasher pool, posted back as
  `events.Hashed` (or its error: the session fails the room).
- `PostWrite` with `checksum` (one-sided): the transport hashes the source stream while it
  copies when it computes the room's algorithm for that buffer (`write_digest_alg`: what the
  transport says, else xxh3 for host buffers, which every transport's fused hash is); else the
  write goes out unhashed and its source spans are hashed here once it landed (the source does
  not change while its room is open), before `events.Written` is posted. Where the transport
  reads the peer's memory as it writes (shm's mapped lane: each destination piece hashed
  right after its copy, in cache, a job split across lanes included), the job's
  `WriteResult` carries those sums (`landed`) and `Written` carries them on as `landed`: the
  writer's verification, which spares the decode its pass over the landed bytes. A write
  without one (another lane, another transport) the decode verifies itself; nothing is read
  back here.

The algorithms themselves are `buffers.devsum.room_checksum` ("xxh3" over host bytes,
"devsum" where the buffer lives); this module decides where and when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from kvhandoff.buffers.bufferset import view_memory
from kvhandoff.buffers.devsum import room_checksum
from kvhandoff.protocol import events as ev
from kvhandoff.protocol.effects import HashSpans, PostWrite
from kvhandoff.transports.base import OneSidedTransport, OnWritten, Transport, WriteResult

HASH_WORKERS = 2
_UNKNOWN: Any = object()  # not asked yet (`Hasher._digest_alg`)
# A hashing job of host memory up to this size runs on the control thread, its `Hashed` fed in
# the same pass: xxh3 of 2 MiB takes about 0.2 ms here, and a hasher job costs two thread
# hand-offs (a worker's wake-up, then the control thread's through the wake pipe), which on a
# loaded 2-core host cost more than that. Small layers are the short prompts' case, where
# the hand-offs are most of a layer's verification; larger jobs keep the pool's parallelism.
HASH_INLINE_BYTES = 2 << 20


class Pool(Protocol):
    """Where the hasher's jobs run (a thread pool; the simulator's queue of jobs)."""

    def submit(self, fn: Callable[[], None]) -> object: ...


class Hasher:
    """The driver's checksums (see the module doc). Keyword-only arguments: `buffers`
    (transport buffer name -> bytes), the `transport` (asked which digest its writes give),
    `post` (hands an event back to the control thread; any thread), `pool` (where jobs run:
    HASH_WORKERS threads unless given) and `inline_bytes` (`inline`)."""

    def __init__(self, *, buffers: dict[str, Any], transport: Transport,
                 post: Callable[[ev.Event], None], pool: Pool | None = None,
                 inline_bytes: int = HASH_INLINE_BYTES) -> None:
        self._buffers = buffers
        self._transport = transport
        self._post = post
        self._threads = ThreadPoolExecutor(max_workers=HASH_WORKERS,
                                           thread_name_prefix="kvh-hash") if pool is None else None
        self._pool: Pool = pool if pool is not None else self._threads  # type: ignore[assignment]
        self._inline_bytes = inline_bytes
        # buffer name -> write_digest_alg's answer (control thread; the agent's buffers and
        # the transport's registrations do not change while it runs): asked for every part of
        # every write, it was ~5 % of a short room's control-thread time
        self._digest_alg: dict[str, str | None] = {}

    def close(self) -> None:
        """Waits for running jobs; queued ones are dropped (the agent is closing)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ HashSpans

    def inline(self, job: HashSpans) -> bool:
        """Whether `job` is hashed on the control thread (`hashed`, its event fed in the same
        pass): at most `inline_bytes`, all of it in host memory (a device sum may wait on the
        device)."""
        total = 0
        for name, _, nbytes in job.spans:
            buf = self._buffers.get(name)
            if buf is None or view_memory(buf)[0] != "host":
                return False
            total += int(nbytes.sum())
        return total <= self._inline_bytes

    def submit(self, job: HashSpans) -> None:
        """(control thread) Hashes `job` on the pool; `Hashed` follows."""
        self._pool.submit(lambda: self._post(self.hashed(job)))

    def hashed(self, job: HashSpans) -> ev.Hashed:
        """(any thread) The sums of a hashing job, with the room's algorithm, on the buffer
        where it lives, as the `Hashed` event; an error is the event's (the session fails the
        room), never raised."""
        try:
            sums = tuple(room_checksum(self._buffers[name], offsets, nbytes, job.alg)
                         for name, offsets, nbytes in job.spans)
        except Exception as e:  # noqa: BLE001 - reported to the session, which fails the room
            return ev.Hashed(job.job, (), error=repr(e))
        return ev.Hashed(job.job, sums)

    # ------------------------------------------------------------------ one-sided writes

    def write_plan(self, eff: PostWrite, post: Callable[[ev.Event], None] | None = None
                   ) -> tuple[bool, OnWritten]:
        """(control thread) How to post `eff`: whether the transport hashes it while copying
        (`checksum=` of `post_writes`), and the completion to give it, which posts `Written`
        with one digest of the room's algorithm per part (through `post` when given: the
        driver's collector of a job of several writes; else the Hasher's)."""
        to = post or self._post
        if eff.checksum:
            algs = self._digest_alg
            fused = True
            for x in eff.parts:
                alg = algs.get(x.buffer, _UNKNOWN)
                if alg is _UNKNOWN:
                    alg = algs[x.buffer] = self.write_digest_alg(x.buffer)
                if alg != eff.alg:
                    fused = False
                    break
        else:
            fused = False
        if fused and eff.alg == "xxh3":  # the landed sums, where the transport read them
            return True, lambda r: to(_written(eff, r, r.landed))
        if fused or not eff.checksum:
            return fused, lambda r: to(_written(eff, r, ()))
        return False, lambda r: self._written_then_hash(eff, r.error, to)

    def write_digest_alg(self, name: str) -> str | None:
        """The algorithm of the digest `transport.post_writes(checksum=True)` gives for buffer
        `name`: what the transport says (`write_digest_alg`, shm: xxh3 of host buffers,
        devsum of CUDA ones), else xxh3 for host buffers (every transport's fused hash) and
        None (none it can give) for device buffers."""
        if isinstance(self._transport, OneSidedTransport):
            alg = self._transport.write_digest_alg(name)
            if alg is not None:
                return alg
        buf = self._buffers.get(name)
        return "xxh3" if buf is not None and view_memory(buf)[0] == "host" else None

    def _written_then_hash(self, eff: PostWrite, exc: BaseException | None,
                           post: Callable[[ev.Event], None]) -> None:
        """(transport thread) A write job whose digests the transport could not compute in
        the room's algorithm ended: hash each part's source spans on the pool, then post
        `Written`."""
        if exc is not None:
            post(ev.Written(eff.op, str(exc)))
            return

        def hash_source() -> None:
            try:
                sums = tuple(room_checksum(self._buffers[x.buffer], x.plan.src_offsets,
                                           x.plan.nbytes, eff.alg) for x in eff.parts)
            except Exception as e:  # noqa: BLE001 - reported to the session (fails the room)
                post(ev.Written(eff.op, f"checksum ({eff.alg}) of the written source "
                                        f"failed: {e!r}"))
                return
            post(ev.Written(eff.op, None, sums))

        try:
            self._pool.submit(hash_source)
        except RuntimeError as e:  # the pool shut down: the agent is closing
            post(ev.Written(eff.op, f"closing: {e}"))


def _written(eff: PostWrite, result: WriteResult, landed: tuple[int | None, ...]) -> ev.Written:
    """The `Written` of a write job whose digests the transport gave: its error, else the
    digests and the landed sums (none when no write of the job was read back)."""
    if result.error is not None:
        return ev.Written(eff.op, str(result.error))
    return ev.Written(eff.op, None, result.digests,
                      landed if any(x is not None for x in landed) else ())
