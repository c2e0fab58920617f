"""The rooms' checksum algorithm: xxh3-64 when both sides' buffers are host memory, the device
checksum (devsum) when either side's are device memory; each side learns the other's kind
from its Hello (`memory`, absent on older peers: host).

In memory (`MemoryWire`, whose hashing is made to honour each effect's `alg`): both sides emit
the same algorithm for every hash and write, a corrupted layer is still caught. Over two real
agents on the shm transport (host buffers; the decode says "cuda" in its Hello): the prefill's
one-sided writes are hashed with devsum after they landed (shm's fused hash is xxh3 of host
bytes), the decode verifies with devsum, byte-exact. Plus the driver's hash dispatch and the
Hello's field and MAC compatibility."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np
import pytest
from protocol.test_session_memory import bad_bytes, kinds, layers, layout, open_room, settings

from kvhandoff.buffers.bufferset import DeviceBytes
from kvhandoff.buffers.checksum import span_checksum
from kvhandoff.buffers.devsum import devsum_reference, room_checksum
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.checksums import checksum_alg
from kvhandoff.protocol.effects import Effect, HashSpans, PostWrite
from kvhandoff.runtime.loop import ControlLoop
from kvhandoff.runtime.seam import Filtered
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side
from kvhandoff.transports.inproc import InprocTransport

from .conftest import Pair
from .test_agent_inproc import PREFIX, SEQ, finish, run_layers


class AlgWire(MemoryWire):
    """A MemoryWire whose hashes and write digests use each effect's `alg`."""

    def _execute(self, side: Side, eff: Effect) -> None:
        if isinstance(eff, HashSpans):
            sums = tuple(room_checksum(side.buffers[b], o, n, eff.alg) for b, o, n in eff.spans)
            self.completions.append((side, ev.Hashed(eff.job, sums)))
            return
        super()._execute(side, eff)

    def _write(self, side: Side, eff: PostWrite) -> None:
        super()._write(side, dataclasses.replace(eff, checksum=False))
        done = self.completions[-1]
        assert isinstance(done[1], ev.Written)
        if eff.checksum and done[1].error is None:
            digests = tuple(room_checksum(side.buffers[x.buffer], x.plan.src_offsets,
                                          x.plan.nbytes, eff.alg) for x in eff.parts)
            self.completions[-1] = (side, ev.Written(eff.op, None, digests))


def _pair(prefill_memory: str, decode_memory: str, *, writes: bool
          ) -> tuple[AlgWire, Side, Side, list[tuple[str, Effect]]]:
    w = AlgWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=settings(), writes=writes)
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings(), writes=writes)
    p.session.set_memory(prefill_memory)
    d.session.set_memory(decode_memory)
    seen: list[tuple[str, Effect]] = []
    run = w._execute

    def execute(side: Side, eff: Effect) -> None:
        seen.append((side.name, eff))
        run(side, eff)

    w._execute = execute  # type: ignore[method-assign]
    return w, p, d, seen


def _all_ready(w: MemoryWire, p: Side, room: int) -> None:
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(room, room, lid))
    w.run()


def test_the_rule() -> None:
    assert checksum_alg("host", "host") == "xxh3"
    assert checksum_alg("host", "cuda") == "devsum"
    assert checksum_alg("cuda", "host") == "devsum"
    assert checksum_alg("cuda", "cuda") == "devsum"


@pytest.mark.parametrize(("pm", "dm", "writes", "alg"), [
    ("host", "host", False, "xxh3"), ("host", "host", True, "xxh3"),
    ("host", "cuda", False, "devsum"), ("cuda", "host", False, "devsum"),
    ("cuda", "cuda", True, "devsum"),
])
def test_both_sides_use_the_rooms_algorithm(pm: str, dm: str, writes: bool, alg: str) -> None:
    w, p, d, seen = _pair(pm, dm, writes=writes)
    open_room(w, p, d, 1)
    w.run()
    hellos = [m for f, _, m in w.sent if isinstance(m, P.Hello)]
    assert {(m.role, m.memory) for m in hellos} == {("prefill", pm), ("decode", dm)}
    _all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0
    hashes = [(s, e.alg) for s, e in seen if isinstance(e, HashSpans)]
    wrote = [e.alg for s, e in seen if isinstance(e, PostWrite)]
    assert {s for s, _ in hashes} == ({"decode:1"} if writes else {"prefill:1", "decode:1"})
    assert {a for _, a in hashes} == {alg}
    assert (set(wrote) == {alg}) if writes else not wrote
    assert d.session.counters["checksums_verified"] == 6
    assert d.session.counters["checksum_failures"] == 0


@pytest.mark.parametrize("writes", [False, True], ids=["two-sided", "one-sided"])
def test_a_corrupted_layer_is_caught_with_devsum(writes: bool) -> None:
    w, p, d, _ = _pair("host", "cuda", writes=writes)
    open_room(w, p, d, 1)
    w.run()
    w.corrupt_next(layers(p.session.layout)[1], "main_kv")
    _all_ready(w, p, 1)
    assert (p.views[1].state, d.views[1].state) == (KVPoll.Success, KVPoll.Success)
    assert "LayerNack" in kinds(w, "decode:1")
    assert d.session.counters["checksum_failures"] == 1
    assert bad_bytes(d) == 0


def test_sides_that_disagree_would_fail_the_check() -> None:
    """The test wire's sensitivity: a prefill announcing xxh3 sums to a decode verifying with
    devsum fails every layer (what the Hello field prevents)."""
    w, p, d, _ = _pair("host", "cuda", writes=False)
    run = w._execute

    def xxh3_on_prefill(side: Side, eff: Effect) -> None:
        if side is p and isinstance(eff, HashSpans):
            eff = dataclasses.replace(eff, alg="xxh3")
        run(side, eff)

    w._execute = xxh3_on_prefill  # type: ignore[method-assign]
    open_room(w, p, d, 1)
    w.run()
    _all_ready(w, p, 1)
    assert d.views[1].state is KVPoll.Failed
    assert d.session.counters["checksum_failures"] >= 1


# ---- the Hello's field -------------------------------------------------------------------

class _OldHello(msgspec.Struct, tag="hello", tag_field="kind", frozen=True):
    """A Hello as a peer that predates `memory` encodes it."""

    src: str
    gen: int
    agent_id: str
    role: str
    transport: str
    transport_address: bytes
    layout: dict[str, object]
    layout_hash: str
    buffers: list[P.BufferDesc]
    mac: bytes = b""


def _hello_kw() -> dict[str, Any]:
    return {"src": "127.0.0.1:5", "gen": 9, "agent_id": "decode-1", "role": "decode",
            "transport": "shm", "transport_address": b"\x00addr\xff",
            "layout": {"model": "m", "pages": [1, 2.5, None]}, "layout_hash": "h",
            "buffers": [P.BufferDesc(region="main_kv", layer=0, nbytes=64, descriptor=b"d")]}


def test_an_older_peers_hello_means_host_and_its_body_is_what_we_sign() -> None:
    """A Hello without `memory` (a peer that predates the field) means host memory, and the
    body such a peer rebuilds from ours is the one our MAC covers (with the recipient's
    address before it). A MAC made without the recipient (before Hellos named it) does not
    verify: the secret's holders must run a release that signs it."""
    secret, to = b"s3cret", "127.0.0.1:7"
    old = _OldHello(**_hello_kw())
    body = msgspec.msgpack.encode(old)
    msg = P.decode([P.HEADER, msgspec.msgpack.encode(msgspec.structs.replace(
        old, mac=hmac.new(secret, to.encode() + b"\0" + body, hashlib.sha256).digest()))],
        max_bytes=1 << 20)
    assert isinstance(msg, P.Hello) and msg.memory == "host"
    assert P.verify_hello(msg, secret, recipient=to)
    unbound = msgspec.structs.replace(msg, mac=hmac.new(secret, body, hashlib.sha256).digest())
    assert not P.verify_hello(unbound, secret, recipient=to)
    ours = P.sign_hello(P.Hello(**_hello_kw()), secret, recipient=to)
    theirs = msgspec.msgpack.Decoder(_OldHello).decode(P.encode(ours)[1])
    rebuilt = msgspec.msgpack.encode(msgspec.structs.replace(theirs, mac=b""))
    assert hmac.compare_digest(
        hmac.new(secret, to.encode() + b"\0" + rebuilt, hashlib.sha256).digest(), ours.mac)


def test_the_mac_covers_a_cuda_memory_field() -> None:
    secret, to = b"s3cret", "127.0.0.1:7"
    signed = P.sign_hello(P.Hello(**_hello_kw(), memory="cuda"), secret, recipient=to)
    back = P.decode(P.encode(signed), max_bytes=1 << 20)
    assert isinstance(back, P.Hello) and back.memory == "cuda"
    assert P.verify_hello(back, secret, recipient=to)
    assert not P.verify_hello(msgspec.structs.replace(back, memory="host"), secret,
                              recipient=to)


def test_an_unknown_memory_kind_is_refused_naming_the_field() -> None:
    w = MemoryWire()
    d = w.add("decode:1", Role.DECODE, layout(), settings=settings())
    me = w.add("prefill:1", Role.PREFILL, layout(), settings=settings()).session.me
    hello = dataclasses.replace(me, memory="tpu").hello(P.Hello, "decode:1")
    w.feed(d, ev.MessageReceived(hello))
    rejects = [m for f, _, m in w.sent if isinstance(m, P.HelloReject)]
    assert rejects and "memory" in rejects[0].reason and "'tpu'" in rejects[0].reason
    with pytest.raises(ValueError, match="memory"):
        d.session.set_memory("tpu")


# ---- the driver's hash dispatch ----------------------------------------------------------

def _loop(buffers: dict[str, Any]) -> ControlLoop:
    return ControlLoop(transport=InprocTransport(Settings(transport="inproc")),
                       buffers=buffers, settings=Settings(transport="inproc"))


def _hashed(loop: ControlLoop, job: HashSpans) -> ev.Hashed:
    return loop._hashing.hashed(job)


def test_the_driver_hashes_with_the_jobs_algorithm() -> None:
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, 4096, dtype=np.uint8)
    off, nb = np.array([1000, 8, 2048]), np.array([400, 132, 1024])
    loop = _loop({"a": buf, "dev": DeviceBytes(1 << 40, 4096, 0, None)})
    try:
        x = _hashed(loop, HashSpans(1, (("a", off, nb),), "xxh3"))
        d = _hashed(loop, HashSpans(2, (("a", off, nb),), "devsum"))
        assert x.sums == (span_checksum(buf, off, nb),) and x.error is None
        assert d.sums == (devsum_reference(buf, off, nb),) and d.error is None
        assert x.sums != d.sums
        # device memory is never hashed as host bytes; an unknown algorithm is named
        bad = _hashed(loop, HashSpans(3, (("dev", off, nb),), "xxh3"))
        assert bad.sums == () and bad.error is not None and "devsum" in bad.error
        unknown = _hashed(loop, HashSpans(4, (("a", off, nb),), "crc"))
        assert unknown.error is not None and "'crc'" in unknown.error
        # devsum needs whole 4-byte words per span
        odd = _hashed(loop, HashSpans(5, (("a", np.array([0]), np.array([6])),), "devsum"))
        assert odd.error is not None and "multiple of 4" in odd.error
    finally:
        loop.close()
        loop.transport.close()


# ---- two real agents over shm ------------------------------------------------------------

class _Recorder:
    """An effect filter that keeps a copy of every effect and lets it through."""

    def __init__(self, into: list[Effect]) -> None:
        self.into = into

    def __call__(self, eff: Effect, now: float) -> Iterable[Effect]:
        self.into.append(eff)
        return (eff,)

    def due(self, now: float) -> Iterable[Effect]:
        return ()

    def next_due(self) -> float | None:
        return None


@pytest.mark.parametrize("decode_memory", ["host", "cuda"])
def test_agents_over_shm_use_the_rooms_algorithm(pair: Callable[..., Pair],
                                                 decode_memory: str) -> None:
    """Host buffers on both sides (no GPU here); with "cuda" the decode's session says so in
    its Hello, as a decode with CUDA buffers would: the room hashes with devsum on both
    sides, the prefill's writes get devsum digests computed after they landed."""
    pr = pair(transport="shm")
    d_eff: list[Effect] = []
    p_eff: list[Effect] = []
    pr.decode.agent._loop.install(lambda step: Filtered(step, _Recorder(d_eff)))
    pr.prefill.agent._loop.install(lambda step: Filtered(step, _Recorder(p_eff)))
    pr.decode.agent._loop.query(lambda s: s.set_memory(decode_memory))
    sender, receiver, _, dst = pr.open(31, SEQ, PREFIX)
    run_layers(pr, sender, receiver)
    assert [s.name for s in finish(sender, receiver)] == ["Success", "Success"]
    bad, touched = pr.verify(dst, SEQ, PREFIX)
    assert bad == 0 and touched == 0
    alg = "devsum" if decode_memory == "cuda" else "xxh3"
    writes = [e for e in p_eff if isinstance(e, PostWrite)]
    assert writes and {e.alg for e in writes} == {alg} and all(e.checksum for e in writes)
    verifies = [e for e in d_eff if isinstance(e, HashSpans)]
    assert verifies and {e.alg for e in verifies} == {alg}
    st = receiver.stats()
    assert sender.stats()["one_sided"] is True
    assert st["checksums_verified"] > 0
    assert pr.decode.agent._session.counters["checksum_failures"] == 0
