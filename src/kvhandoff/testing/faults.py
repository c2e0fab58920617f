"""Fault injection for tests, outside the product: a transport wrapper and a message filter.

- `FaultyTransport(inner, ...)` wraps any `Transport`: corrupt one byte of a landed region of a
  layer (main KV or indexer, `Corrupt`), stall a layer's sends (never posted; cancel/close
  still complete them), fail a layer's ops with a `TransportError`, or end the process
  (`os._exit(137)`) when a layer is about to be sent. A corruption acts where the bytes land
  on this side: a receive (two-sided decode) or a one-sided write (its checksum is of the true
  bytes, the peer holds a flipped one: over shm, directly or through auto, the byte is flipped
  inside the copy job, right after its piece was copied and before the writer hashes what
  landed, `post_writes_tampered` here, so the writer's own verification sees it; over
  other one-sided transports, or a job shm splits, one flipped byte is written after the real
  write landed, and a landed sum the job's result carries for that write is read again
  through shm's private read-back, so it is of the flipped byte); with one-sided writes
  configure it on the prefill, the decode then posts nothing to corrupt.
  `receive_corruption=True` (what `from_config` sets for a decode with corruptions) makes a
  decode offer no buffers for writes, so its corruptions act on the two-sided receives.
  `hang_connect` makes a connect to the named peers wait as one to a peer that never
  answers; `fail_cancel` makes cancel() raise after forwarding, as a copy that did not stop.
- `MessageFaults(...)` is an agent `effect_filter`: drop control messages of some kinds, delay
  every message (it holds them and hands them back to the driver when due), or send no
  heartbeats.
- `python -m kvhandoff.testing.faults prefill|decode '<json config>'` runs `kvhandoff.engine_sim`
  with the faults of the config's ``"faults"`` key (`from_config`), for tests with real processes.

The agent never knows: the wrapper sits where the transport sits, the filter where effects
leave the transfer core.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.errors import TransportError
from kvhandoff.kv_layout.spans import SpanPlan, plan_of
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Effect, Send
from kvhandoff.transports.base import (
    OnDone,
    OneSidedTransport,
    OnWritten,
    Transport,
    TransportStatus,
    WriteResult,
    WriteSpec,
    _post_in_groups,
)

log = logging.getLogger("kvhandoff.testing.faults")

CRASH_EXIT_CODE = 137
SCRATCH = "fault/scratch"  # the 1-byte buffer a corrupting write copies from


@dataclass
class Corrupt:
    """Flip one byte of the first span of `region` of `layer` each time it lands (before the
    agent verifies it), `times` times in all (2 per room defeats the one retransmit)."""

    layer: int
    region: str = "main_kv"
    times: int = 1
    offset: int = 0  # byte offset into the first span


@dataclass
class _Held:
    peer: str
    tag: int
    on_done: OnDone


@dataclass
class FaultLog:
    """What a `FaultyTransport` did (tests assert the fault fired)."""

    corrupted: list[tuple[int, str, int]] = field(default_factory=list)  # (layer, region, off)
    stalled: int = 0
    failed: int = 0
    hung_connects: int = 0
    failed_cancels: int = 0


class FaultyTransport(Transport):
    """A `Transport` that forwards to `inner` and injects the configured faults; a
    `FaultyOneSidedTransport` (one-sided writes forwarded) when `inner` has them and
    `receive_corruption` is off."""

    def __new__(cls, inner: Transport, **kw: Any) -> FaultyTransport:  # noqa: D102
        if (cls is FaultyTransport and isinstance(inner, OneSidedTransport)
                and not kw.get("receive_corruption")):
            cls = FaultyOneSidedTransport
        return super().__new__(cls)

    def __init__(self, inner: Transport, *, corrupt: Iterable[Corrupt] = (),  # noqa: D107
                 stall_layers: Iterable[int] = (), fail_layers: Iterable[int] = (),
                 crash_layer: int | None = None, receive_corruption: bool = False,
                 hang_connect: Iterable[str] = (), fail_cancel: str | None = None) -> None:
        self.inner = inner
        # a connect to one of these peers (control addresses) waits, as one to a peer that
        # never answers, until `release_connects()` or close(), then fails
        self.hang_connect = set(hang_connect)
        self._unhang = threading.Event()
        # cancel() raises TransportError(fail_cancel) after forwarding: a copy that did not
        # stop (what shm raises when a local copy outlives its bound)
        self.fail_cancel = fail_cancel
        self.kind = inner.kind  # type: ignore[misc]  # the wrapped transport's kind
        self._corrupt = list(corrupt)
        self._stall = frozenset(stall_layers)
        self._fail = frozenset(fail_layers)
        self._crash = crash_layer
        self._bufs: dict[str, np.ndarray] = {}
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self.log = FaultLog()
        # one-sided writes: forwarded when the inner transport has them; a corruption is a
        # byte flipped inside shm's copy job, else a second 1-byte write of a flipped source
        # byte after the real one landed (so the writer's checksum is of the true bytes and
        # the landed ones differ)
        # (a FaultyOneSidedTransport, see __new__); a decode that corrupts what it receives
        # offers no buffers (receive_corruption: a plain FaultyTransport)
        self._scratch = np.zeros(1, dtype=np.uint8)
        if isinstance(self, OneSidedTransport) and self._corrupt:
            inner.register(SCRATCH, self._scratch)

    # --- plain forwarding --------------------------------------------------------------------

    @property
    def address(self) -> bytes:
        return self.inner.address

    def register(self, name: str, buf: np.ndarray) -> None:
        self._bufs[name] = buf
        self.inner.register(name, buf)

    def connect(self, peer: str, address: bytes) -> None:
        if peer in self.hang_connect:
            self.log.hung_connects += 1
            self._unhang.wait()
            raise TransportError(f"connect {peer!r}: the peer never answered (fault)")
        self.inner.connect(peer, address)

    def bind_session(self, peer: str, key: bytes) -> None:
        self.inner.bind_session(peer, key)

    def release_connects(self) -> None:
        """Ends the connects `hang_connect` holds (they fail)."""
        self._unhang.set()

    def disconnect(self, peer: str) -> None:
        self._complete_held(lambda h: h.peer == peer, "disconnected")
        self.inner.disconnect(peer)

    def status(self) -> TransportStatus:
        return self.inner.status()

    def peer_exited(self, peer: str) -> bool:
        return self.inner.peer_exited(peer)

    def cancel(self, peer: str, tag: int) -> None:
        self._complete_held(lambda h: h.peer == peer and h.tag == tag, "cancelled")
        self.inner.cancel(peer, tag)
        if self.fail_cancel is not None:
            self.log.failed_cancels += 1
            raise TransportError(f"cancel tag {tag} peer {peer!r}: {self.fail_cancel} (fault)")

    def close(self) -> None:
        self._unhang.set()
        self._complete_held(lambda h: True, "transport closed")
        self.inner.close()

    # --- faults ------------------------------------------------------------------------------

    def _faulty(self, layer: int) -> bool:
        """Whether an outgoing op of `layer` crashes, stalls or fails."""
        return layer == self._crash or layer in self._stall or layer in self._fail

    def _outgoing_fault(self, peer: str, tag: int, on_done: OnDone) -> bool:
        """Crash, stall or fail an outgoing op of the configured layers (True: handled)."""
        _, layer, _, _ = P.split_tag(tag)
        if self._crash is not None and layer == self._crash:
            log.error("fault injection: the process exits at layer %d", layer)
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        if layer in self._stall:
            with self._lock:
                self._held.append(_Held(peer, tag, on_done))
                self.log.stalled += 1
            return True
        if layer in self._fail:
            self._fail_later(on_done, f"injected send failure on layer {layer}")
            return True
        return False

    def post_send(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        if not self._outgoing_fault(peer, tag, on_done):
            self.inner.post_send(peer, tag, name, offsets, nbytes, on_done)

    def post_recv(self, peer: str, tag: int, name: str, offsets: np.ndarray, nbytes: np.ndarray,
                  on_done: OnDone) -> None:
        _, layer, _, _ = P.split_tag(tag)
        if layer in self._fail:
            self._fail_later(on_done, f"injected receive failure on layer {layer}")
            return
        region = name.rsplit("/", 1)[0]
        spec = next((c for c in self._corrupt if c.layer == layer and c.region == region), None)
        if spec is None or not len(offsets):
            self.inner.post_recv(peer, tag, name, offsets, nbytes, on_done)
            return
        off = int(offsets[0]) + min(spec.offset, int(nbytes[0]) - 1)

        def landed(exc: BaseException | None) -> None:
            if exc is None:
                with self._lock:
                    fire = spec.times > 0
                    spec.times -= fire
                if fire:
                    self._bufs[name][off] ^= 0xFF
                    self.log.corrupted.append((layer, region, off))
                    log.warning("fault injection: flipped byte %d of %s", off, name)
            on_done(exc)

        self.inner.post_recv(peer, tag, name, offsets, nbytes, landed)

    def _fail_later(self, on_done: OnDone, why: str) -> None:
        """Completes an op with an error from another thread, as a transport does."""
        self.log.failed += 1
        threading.Thread(target=on_done, args=(TransportError(why),), daemon=True,
                         name="kvh-fault").start()

    def _complete_held(self, which: Any, why: str) -> None:
        with self._lock:
            done = [h for h in self._held if which(h)]
            self._held = [h for h in self._held if not which(h)]
        for h in done:
            self._fail_later(h.on_done, f"stalled op {why}")



class FaultyOneSidedTransport(FaultyTransport, OneSidedTransport):
    """FaultyTransport over a transport with one-sided writes: they are forwarded. A
    corruption of a write job over shm (itself, or auto's same-host lane) flips the first
    destination byte of the region inside the copy, after that piece's copy and before its
    landed hash (`post_writes_tampered`): the writer's fused verification of what landed must
    catch it. Elsewhere (other transports, a job shm splits) it is a second 1-byte write of a
    flipped source byte after the real one landed, before the job's completion is handed on;
    the landed sum the result carries for that write (shm's copy read it before the flip) is
    then read again (`ShmTransport._landed_digest`), or dropped (None: the decode verifies)
    where nothing can read it. Either way the writer's checksum is of the true bytes and the
    landed ones differ. A corruption counts as done once its job is posted."""

    @property
    def _writer(self) -> OneSidedTransport:
        assert isinstance(self.inner, OneSidedTransport)
        return self.inner

    def describe(self, name: str) -> bytes:
        return self._writer.describe(name)

    def register_remote(self, peer: str, name: str, descriptor: bytes) -> None:
        self._writer.register_remote(peer, name, descriptor)

    def write_digest_alg(self, name: str) -> str | None:
        return self._writer.write_digest_alg(name)

    def _corruptions(self, writes: Sequence[WriteSpec]) -> list[_Flip]:
        """The configured corruptions that match a write of `writes` (its layer and region)."""
        found = []
        for i, (tag, name, remote, plan) in enumerate(writes):
            _, layer, _, _ = P.split_tag(tag)
            region = name.rsplit("/", 1)[0]
            spec = next((c for c in self._corrupt if c.layer == layer and c.region == region),
                        None)
            if spec is not None and len(plan):
                found.append(_Flip(spec, tag, name, remote, plan, layer, region, i))
        return found

    def _shm_writer(self, peer: str) -> Any:
        """The ShmTransport that writes to `peer` (the inner one, or auto's same-host part),
        None if none does (its copy job is where a corruption is injected)."""
        from kvhandoff.transports.auto import AutoTransport
        from kvhandoff.transports.shm.transport import ShmTransport

        inner: Transport = self._writer
        if isinstance(inner, AutoTransport) and inner.route(peer) == "shm":
            inner = inner._shm  # auto has no public accessor of its parts
        return inner if isinstance(inner, ShmTransport) else None

    def _in_copy(self, peer: str, writes: Sequence[WriteSpec], flips: list[_Flip],
                 on_done: OnWritten, checksum: bool) -> bool:
        """Posts `writes` as a shm copy job that flips a byte of each due corruption's region
        inside the copy; False (nothing posted, nothing counted) where shm does not write
        them as one host job."""
        shm = self._shm_writer(peer)
        if shm is None:
            return False
        with self._lock:
            due = [f for f in flips if f.spec.times > 0]
            for f in due:
                f.spec.times -= 1
        if not due:
            self._writer.post_writes(peer, writes, on_done, checksum=checksum)
            return True
        if not post_writes_tampered(shm, peer, writes, on_done, {f.index: 0 for f in due},
                                    checksum=checksum):
            with self._lock:
                for f in due:
                    f.spec.times += 1
            return False
        for f in due:
            dst = int(f.plan.dst_offsets[0])
            self.log.corrupted.append((f.layer, f.region, dst))
            log.warning("fault injection: flipped byte %d of the peer's %s inside the copy",
                        dst, f.remote)
        return True

    def _after_landed(self, peer: str, flips: list[_Flip], result: WriteResult,
                      on_done: OnWritten) -> None:
        """A write (job) landed: flip one byte of each region in `flips` whose corruption is
        still due, one 1-byte write after the other, then hand the job's result on with the
        flipped writes' landed sums read again (`_relanded`)."""
        with self._lock:
            due = [f for f in flips if result.error is None and f.spec.times > 0]
            for f in due:
                f.spec.times -= 1
        if result.error is not None or not due:
            on_done(result)
            return

        def flip(i: int, err: BaseException | None) -> None:
            if err is not None:
                on_done(WriteResult(err))
                return
            if i == len(due):
                on_done(self._relanded(peer, due, result))
                return
            f = due[i]
            src, dst = int(f.plan.src_offsets[0]), int(f.plan.dst_offsets[0])
            self._scratch[0] = self._bufs[f.name][src] ^ 0xFF
            self.log.corrupted.append((f.layer, f.region, dst))
            log.warning("fault injection: flipping byte %d of the peer's %s", dst, f.remote)
            self._writer.post_writes(peer, [(f.tag, SCRATCH, f.remote, plan_of([0], [dst], [1]))],
                                     lambda r: flip(i + 1, r.error))

        flip(0, None)

    def _relanded(self, peer: str, flipped: list[_Flip], result: WriteResult) -> WriteResult:
        """`result` with the landed sum of each write in `flipped` read again after its byte
        was flipped (shm's private read-back of a mapped target), or None where nothing can
        read it: a sum the copy computed before the flip would vouch for bytes the peer no
        longer holds."""
        if not result.landed:
            return result
        shm = self._shm_writer(peer)
        landed = list(result.landed)
        for f in flipped:
            if landed[f.index] is None:
                continue
            try:
                landed[f.index] = (None if shm is None
                                   else shm._landed_digest(peer, f.remote, f.plan))
            except Exception as e:  # noqa: BLE001 - the job fails, naming it
                return WriteResult(TransportError(f"fault injection: reading back {f.remote!r} "
                                                  f"after the flip failed: {e!r}"))
        return WriteResult(None, result.digests,
                           tuple(landed) if any(x is not None for x in landed) else ())

    def post_writes(self, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten, *,
                    checksum: bool = False) -> None:
        """Forwarded as one job (the faults of its layer: a stall, failure or crash of the
        whole job); each corrupted region gets its byte flipped inside the copy (shm) or once
        the job landed (elsewhere). A job of several layers (the agent's batch of short layers
        ready together) one of which has a stall, failure or crash is posted as one job per
        layer, so that fault hits its own layer's writes only (the others are copied); the
        job still has one completion (`base._post_in_groups`): a stall holds all of it, a
        failure fails all of it, as a real job's would."""
        layers = list(dict.fromkeys(P.split_tag(w[0])[1] for w in writes))
        if len(layers) > 1 and any(self._faulty(layer) for layer in layers):
            groups = [[i for i, w in enumerate(writes) if P.split_tag(w[0])[1] == layer]
                      for layer in layers]
            _post_in_groups(lambda idx, done: self.post_writes(
                peer, [writes[i] for i in idx], done, checksum=checksum), groups, on_done)
            return
        if writes and self._outgoing_fault(peer, writes[0][0],
                                           lambda exc: on_done(WriteResult(exc))):
            return
        flips = self._corruptions(writes)
        if not flips:
            self._writer.post_writes(peer, writes, on_done, checksum=checksum)
            return
        if self._in_copy(peer, writes, flips, on_done, checksum):
            return
        self._writer.post_writes(peer, writes,
                                 lambda r: self._after_landed(peer, flips, r, on_done),
                                 checksum=checksum)


def post_writes_tampered(shm: Any, peer: str, writes: Sequence[WriteSpec], on_done: OnWritten,
                         flips: dict[int, int], *, checksum: bool = False) -> bool:
    """`post_writes` of host memory on ShmTransport `shm` as one copy job that flips the first
    destination byte of write i's piece `flips[i]` right after that piece was copied and
    before it is hashed as landed (the transport's private seam, `_post_writes_tampered`):
    the peer holds a byte that is not the source's and the landed sum is of what it holds.
    False, and nothing posted, where the writes are not one host job (CUDA buffers, targets
    on both host lanes): the caller corrupts otherwise."""
    from kvhandoff.transports.shm.transport import ShmTransport

    if not isinstance(shm, ShmTransport):
        raise TypeError(f"post_writes_tampered: shm must be a ShmTransport, not {type(shm)!r}")
    return shm._post_writes_tampered(peer, writes, on_done, flips, checksum=checksum)


@dataclass(frozen=True)
class _Flip:
    """A corruption due on one write of a job: its spec and the write it flips a byte of."""

    spec: Corrupt
    tag: int
    name: str
    remote: str
    plan: SpanPlan
    layer: int
    region: str
    index: int  # the write's place in its job


class MessageFaults:
    """An agent `effect_filter` for control messages: `drop` names message classes
    (``"RoomAck"``, ``"LayerDone"``...) to drop (at most `drop_times` of them, None: all),
    `delay_s` delays every message, `refuse_heartbeats` drops every heartbeat."""

    def __init__(self, *, drop: Iterable[str] = (), drop_times: int | None = None,
                 delay_s: float = 0.0, refuse_heartbeats: bool = False) -> None:
        self.drop = frozenset(drop)
        self.drop_left = drop_times
        self.delay_s = delay_s
        self.refuse_heartbeats = refuse_heartbeats
        self.dropped: list[str] = []
        self._lock = threading.Lock()
        # delayed messages: (due, seq, effect); only the driver's thread touches it
        self._held: list[tuple[float, int, Effect]] = []
        self._seq = itertools.count()

    def __call__(self, eff: Effect, now: float) -> list[Effect]:
        if not isinstance(eff, Send):
            return [eff]
        kind = type(eff.msg).__name__
        if self.refuse_heartbeats and isinstance(eff.msg, P.Heartbeat):
            return []
        if kind in self.drop:
            with self._lock:
                if self.drop_left is None or self.drop_left > 0:
                    if self.drop_left is not None:
                        self.drop_left -= 1
                    self.dropped.append(kind)
                    return []
        if self.delay_s:
            heapq.heappush(self._held, (now + self.delay_s, next(self._seq), eff))
            return []
        return [eff]

    def due(self, now: float) -> list[Effect]:
        """The delayed messages due by `now`, in the order they were held."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(heapq.heappop(self._held)[2])
        return out

    def next_due(self) -> float | None:
        return self._held[0][0] if self._held else None


def from_config(faults: dict[str, Any], inner: Transport, role: str = "") -> dict[str, Any]:
    """The agent keyword arguments (`transport`, `effect_filter`) of a JSON fault config:
    ``{"corrupt": [{"layer": 5, "region": "indexer_k", "times": 2}], "stall_layers": [3],
    "fail_layers": [], "crash_layer": 10, "drop": ["RoomAck"], "delay_ms": 0,
    "refuse_heartbeats": false}`` (every key optional). A decode (`role`) with corruptions
    receives two-sided, where they act (`FaultyTransport.receive_corruption`)."""
    corrupt = [Corrupt(**c) for c in faults.get("corrupt", [])]
    kw: dict[str, Any] = {"transport": FaultyTransport(
        inner, corrupt=corrupt,
        stall_layers=faults.get("stall_layers", ()), fail_layers=faults.get("fail_layers", ()),
        crash_layer=faults.get("crash_layer"),
        receive_corruption=role == "decode" and bool(corrupt))}
    if faults.get("drop") or faults.get("delay_ms") or faults.get("refuse_heartbeats"):
        kw["effect_filter"] = MessageFaults(
            drop=faults.get("drop", ()), delay_s=float(faults.get("delay_ms", 0)) / 1e3,
            refuse_heartbeats=bool(faults.get("refuse_heartbeats")))
    return kw


def main(argv: list[str] | None = None) -> int:
    """`kvhandoff.engine_sim` with the faults of the config's ``"faults"`` key."""
    from kvhandoff.engine_sim import engine as sim
    from kvhandoff.settings import Settings
    from kvhandoff.transports.base import load_transport

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvhandoff.testing.faults prefill|decode '<json config>'",
              file=sys.stderr)
        return 2
    cfg = json.loads(args[1])
    settings = Settings(**cfg.get("settings", {}))

    def agent_kw() -> dict[str, Any]:
        return from_config(cfg.get("faults", {}), load_transport(settings.transport, settings),
                           args[0])

    return sim.main(args, agent_kw=agent_kw)


if __name__ == "__main__":
    sys.exit(main())
