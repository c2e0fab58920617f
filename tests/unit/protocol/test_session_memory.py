"""The transfer protocol without threads, sockets or sleeps: two `TransferSession`s wired in
memory (`kvhandoff.testing.memory.MemoryWire`), a fake clock, driven step by step. Covers the
handshake, the per-layer flow, the retransmit after a checksum mismatch, abort races, peer loss
and lease expiry; every message goes through the real wire format.

Room ids double as the engine's tokens here (small ints: the session compares tokens by
identity)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import FailureKind
from kvhandoff.kv_layout import LayoutSpec
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.lifecycle import write_quarantine
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side


@pytest.fixture(autouse=True, params=[False, True], ids=["two-sided", "one-sided"])
def one_sided(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each test runs on both data paths: sends and receives, and one-sided writes (the
    prefill writes into the decode's pages, the decode posts nothing)."""
    monkeypatch.setattr(MemoryWire, "writes", request.param)
    return bool(request.param)

SEQ = 40  # 2.5 pages of 16 tokens
HB = 0.5


def layout(indexer: tuple[int, ...] = (1, 3)) -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=4, indexer_layer_ids=indexer,
                          page_size_tokens=16).without_page_rules()


def layers(lay: LayoutSpec) -> list[int]:
    return sorted({lid for r in lay.regions for lid in r.layer_ids})


def settings(**kw: object) -> Settings:
    return Settings(transport="inproc", heartbeat_interval_s=HB, lease_s=5.0, **kw)


def pair(*, decode_layout: LayoutSpec | None = None, prefill: Settings | None = None,
         decode: Settings | None = None) -> tuple[MemoryWire, Side, Side]:
    w = MemoryWire()
    p = w.add("prefill:1", Role.PREFILL, layout(), settings=prefill or settings())
    d = w.add("decode:1", Role.DECODE, decode_layout or layout(), settings=decode or settings())
    return w, p, d


def pages(n: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset, offset + n, dtype=np.int64)


def open_room(w: MemoryWire, p: Side, d: Side, room: int, *, seq: int = SEQ,
              peer: str = "prefill:1") -> None:
    lay = p.session.layout
    src = pages(-(-seq // 16))
    for ri, reg in enumerate(lay.regions):
        for lid in reg.layer_ids:
            write_tokens(p.buffers[f"{reg.name}/{lid}"], lay, ri, lid, src, 0, seq, 7)
    w.feed(p, ev.OpenSender(room, room, {r.name: src for r in lay.regions}, seq, 1))
    w.feed(d, ev.OpenReceiver(room, room, ((peer, 0),)))
    dst = pages(-(-seq // 16), offset=5)
    w.feed(d, ev.ReceiverInit(room, room, {r.name: dst for r in lay.regions}, seq, 0))


def bad_bytes(d: Side, seq: int = SEQ) -> int:
    lay = d.session.layout
    dst = pages(-(-seq // 16), offset=5)
    return sum(check_tokens(d.buffers[f"{reg.name}/{lid}"], lay, ri, lid, dst, 0, seq, 7)
               for ri, reg in enumerate(lay.regions) for lid in reg.layer_ids)


def kinds(w: MemoryWire, frm: str) -> list[str]:
    return [type(m).__name__ for f, _, m in w.sent if f == frm and not isinstance(m, tuple)]


# ---------------------------------------------------------------------------- handshake + flow


def test_handshake_then_layer_by_layer_to_success() -> None:
    w, p, d = pair()
    open_room(w, p, d, 1)
    w.run()
    # decode said Hello first; prefill acked; then request / accept
    assert kinds(w, "decode:1")[:2] == ["Hello", "TransferRequest"]
    assert kinds(w, "prefill:1")[:2] == ["HelloAck", "TransferAccepted"]
    assert d.views[1].state is KVPoll.WaitingForInput
    assert p.views[1].state is KVPoll.WaitingForInput
    for i, lid in enumerate(layers(p.session.layout)):
        w.feed(p, ev.LayerReady(1, 1, lid))
        w.run()
        assert d.views[1].landed == frozenset(layers(p.session.layout)[:i + 1])
    assert d.views[1].state is KVPoll.Success and p.views[1].state is KVPoll.Success
    assert d.views[1].releases == 1 and p.views[1].releases == 1
    assert bad_bytes(d) == 0
    assert "RoomAck" in kinds(w, "decode:1")
    c = d.session.counters
    assert c["checksums_verified"] == 4 + 2 and c["checksum_failures"] == 0


def test_layers_ready_before_the_request_go_out_on_accept() -> None:
    w, p, d = pair()
    lay = p.session.layout
    src = pages(3)
    w.feed(p, ev.OpenSender(2, 2, {r.name: src for r in lay.regions}, SEQ, 1))
    for lid in layers(lay):
        w.feed(p, ev.LayerReady(2, 2, lid))
    assert p.views[2].state is KVPoll.Bootstrapping  # nobody asked yet
    w.feed(d, ev.OpenReceiver(2, 2, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(2, 2, {r.name: pages(3, 5) for r in lay.regions}, SEQ, 0))
    w.run()
    assert (p.views[2].state, d.views[2].state) == (KVPoll.Success, KVPoll.Success)


def test_layout_mismatch_fails_both_sides_at_the_handshake() -> None:
    w, p, d = pair(decode_layout=layout(indexer=(1, 2)))
    open_room(w, p, d, 3)
    w.run()
    assert d.views[3].state is KVPoll.Failed
    f = d.views[3].failure
    assert f is not None and f.kind is FailureKind.LAYOUT_MISMATCH
    assert "indexer_k.layer_ids: prefill=[1, 3] decode=[1, 2]" in f.diff
    assert "HelloReject" in kinds(w, "prefill:1")
    assert "TransferRequest" not in kinds(w, "decode:1")


# ---------------------------------------------------------------------------- checksums


def test_checksum_mismatch_is_retransmitted_once_then_lands() -> None:
    w, p, d = pair()
    open_room(w, p, d, 4)
    w.run()
    w.corrupt_next(1, "indexer_k")
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(4, 4, lid))
    w.run()
    assert (p.views[4].state, d.views[4].state) == (KVPoll.Success, KVPoll.Success)
    assert bad_bytes(d) == 0  # the retransmit overwrote the flipped byte
    nacks = [m for f, _, m in w.sent if isinstance(m, P.LayerNack)]
    assert [(m.layer, m.attempt) for m in nacks] == [(1, 0)]
    assert d.session.counters["checksum_failures"] == 1
    assert p.session.counters["retransmits"] == 1


def test_checksum_mismatch_twice_fails_naming_layer_and_region() -> None:
    w, p, d = pair()
    open_room(w, p, d, 5)
    w.run()
    w.corrupt_next(2, "main_kv")
    w.corrupt_next(2, "main_kv")
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(5, 5, lid))
    w.run()
    fd, fp = d.views[5].failure, p.views[5].failure
    assert fd is not None and (fd.kind, fd.layer, fd.region) == (FailureKind.CHECKSUM, 2,
                                                                 "main_kv")
    assert fp is not None and fp.kind is FailureKind.CHECKSUM and fp.remote
    assert "checksum mismatch on layer 2, region 'main_kv'" in fp.reason
    assert d.views[5].releases == 1 and p.views[5].releases == 1


# ---------------------------------------------------------------------------- aborts


def test_abort_races_the_last_layer_done() -> None:
    """Decode aborts while the prefill's LayerDone of the last layer is on the wire: decode
    ends Failed (its abort), the late LayerDone changes nothing, prefill Failed with the
    decode's reason; each side releases once, after its ops completed."""
    w, p, d = pair()
    open_room(w, p, d, 6)
    w.run()
    lay = p.session.layout
    for lid in layers(lay)[:-1]:
        w.feed(p, ev.LayerReady(6, 6, lid))
    w.run()
    w.hold(lambda f, t, m: isinstance(m, P.LayerDone))
    w.feed(p, ev.LayerReady(6, 6, layers(lay)[-1]))
    w.run()
    assert d.views[6].state is KVPoll.Transferring
    w.feed(d, ev.AbortRoom(6, 6, "client went away"))
    w.release_held()
    w.run()
    assert d.views[6].state is KVPoll.Failed and p.views[6].state is KVPoll.Failed
    fd, fp = d.views[6].failure, p.views[6].failure
    assert fd is not None and fd.kind is FailureKind.ABORTED and "client went away" in fd.reason
    assert fp is not None and fp.kind is FailureKind.ABORTED and fp.remote
    assert d.views[6].releases == 1 and p.views[6].releases == 1
    assert "AbortAck" in kinds(w, "prefill:1")


def test_both_sides_abort_at_once_first_reason_kept() -> None:
    w, p, d = pair()
    open_room(w, p, d, 7)
    w.run()
    w.feed(p, ev.LayerReady(7, 7, 0))
    w.feed(p, ev.AbortRoom(7, 7, "prefill evicted"))
    w.feed(d, ev.AbortRoom(7, 7, "decode gave up"))
    w.feed(d, ev.AbortRoom(7, 7, "decode again"))
    w.run()
    fp, fd = p.views[7].failure, d.views[7].failure
    assert fp is not None and "prefill evicted" in fp.reason
    assert fd is not None and "decode gave up" in fd.reason
    assert p.views[7].releases == 1 and d.views[7].releases == 1


def test_abort_before_the_engine_opened_the_room_is_kept() -> None:
    """The decode's Abort can reach the prefill before its engine opens the room: kept, and
    the room fails as soon as it is opened."""
    w, p, d = pair()
    lay = d.session.layout
    w.feed(d, ev.OpenReceiver(8, 8, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(8, 8, {r.name: pages(3, 5) for r in lay.regions}, SEQ, 0))
    w.feed(d, ev.AbortRoom(8, 8, "request cancelled"))
    w.run()
    w.feed(p, ev.OpenSender(8, 8, {r.name: pages(3) for r in lay.regions}, SEQ, 1))
    w.run()
    fp = p.views[8].failure
    assert fp is not None and fp.kind is FailureKind.ABORTED and "request cancelled" in fp.reason
    assert p.views[8].releases == 1


# ---------------------------------------------------------------------------- time


def test_silent_peer_is_lost_after_two_heartbeats(one_sided: bool) -> None:
    w, p, d = pair()
    open_room(w, p, d, 9)
    w.run()
    w.feed(p, ev.LayerReady(9, 9, 0))
    w.run()
    w.drop(lambda f, t, m: f == "prefill:1")  # the prefill process froze
    w.tick(HB)
    w.run()
    assert d.views[9].state is KVPoll.Transferring  # one heartbeat of silence: not yet
    for _ in range(3):
        w.tick(HB)
        w.run()
    f = d.views[9].failure
    assert f is not None and f.kind is FailureKind.PEER_LOST and "silent" in f.reason
    if one_sided:  # the frozen prefill could still write: held for the write quarantine
        assert d.views[9].releases == 0
        w.tick(write_quarantine(d.session.settings))
        w.run()
    assert d.views[9].releases == 1  # its posted receives were cancelled, then released
    assert d.session.counters["peers_lost"] == 1


def test_lost_room_ack_ends_the_prefill_room_by_its_lease() -> None:
    lease = 2.0
    w, p, d = pair(prefill=settings().model_copy(update={"lease_s": lease}))
    w.drop(lambda f, t, m: isinstance(m, P.RoomAck))
    open_room(w, p, d, 10)
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(10, 10, lid))
    w.run()
    assert d.views[10].state is KVPoll.Success
    assert p.views[10].state is KVPoll.Transferring  # no ack: waits
    t0 = w.clock()
    while p.views[10].state is KVPoll.Transferring and w.clock() - t0 < 3 * lease:
        w.tick(HB)  # decode's heartbeats no longer name the finished room: no renewal
        w.run()
    f = p.views[10].failure
    assert f is not None and f.kind is FailureKind.DEADLINE and f.deadline == "lease"
    assert w.clock() - t0 <= lease + 2 * HB
    assert p.views[10].releases == 1


def test_peer_restart_is_detected_by_its_generation() -> None:
    w, p, d = pair()
    open_room(w, p, d, 11)
    w.run()
    # a new process on the same address says Hello with another generation
    w.feed(d, ev.MessageReceived(P.Hello(
        src="prefill:1", gen=999, agent_id="prefill-new", role="prefill", transport="memory",
        transport_address=b"x", layout=p.session.layout.to_dict(),
        layout_hash=p.session.me.layout_hash, buffers=[])))
    w.run()
    f = d.views[11].failure
    assert f is not None and f.kind is FailureKind.PEER_LOST and "restarted" in f.reason


# ---------------------------------------------------------------------------- purity


PROTOCOL_DIR = pathlib.Path(__file__).resolve().parents[3] / "src" / "kvhandoff" / "protocol"
SANS_IO = sorted(p.name for p in PROTOCOL_DIR.glob("*.py"))
FORBIDDEN = {"zmq", "threading", "time", "socket", "os", "logging", "asyncio", "selectors",
             "concurrent", "ucxx", "ucp", "kvhandoff.transports", "kvhandoff.runtime",
             "kvhandoff.testing"}


def test_the_sans_io_check_reads_the_whole_protocol_folder() -> None:
    import kvhandoff.protocol

    assert pathlib.Path(kvhandoff.protocol.__file__).parent == PROTOCOL_DIR
    assert {"session.py", "wire.py", "events.py", "effects.py"} <= set(SANS_IO)


@pytest.mark.parametrize("name", SANS_IO)
def test_the_protocol_modules_do_no_io(name: str) -> None:
    path = PROTOCOL_DIR / name
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found |= {m for m in mods for bad in FORBIDDEN if m == bad or m.startswith(bad + ".")}
    assert not found, f"{name} imports {sorted(found)}"


@pytest.mark.parametrize("name", SANS_IO)
def test_no_protocol_class_declares_another_classes_attributes(name: str) -> None:
    """The session's parts are objects it holds, not mixins: no class of the folder declares,
    under TYPE_CHECKING, attributes some other class provides."""
    tree = ast.parse((PROTOCOL_DIR / name).read_text())
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in cls.body:
            assert not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)), \
                f"{name}: class {cls.name} has a TYPE_CHECKING block"


def test_importing_the_session_loads_no_zmq_and_no_transport() -> None:
    code = ("import sys, kvhandoff.protocol.session, kvhandoff.testing.memory; "
            "bad = [m for m in sys.modules if m == 'zmq' or m.startswith('zmq.') or "
            "m.startswith('kvhandoff.transports') or m == 'ucxx']; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_abort_fed_before_its_open_applies_when_the_room_opens() -> None:
    """The driver feeds an engine's abort ahead of queued events, so it can reach the session
    before the room's open: it is kept and applied at the open (after the handshake started,
    so the peer is told, as for an abort right after the open)."""
    w, p, d = pair()
    lay = d.session.layout
    w.feed(d, ev.AbortRoom(12, 12, "client closed"))
    assert 12 not in d.views
    w.feed(d, ev.OpenReceiver(12, 12, (("prefill:1", 0),)))
    w.feed(d, ev.ReceiverInit(12, 12, {r.name: pages(3, 5) for r in lay.regions}, SEQ, 0))
    w.feed(p, ev.OpenSender(12, 12, {r.name: pages(3) for r in lay.regions}, SEQ, 1))
    w.run()
    fd, fp = d.views[12].failure, p.views[12].failure
    assert fd is not None and fd.kind is FailureKind.ABORTED and "client closed" in fd.reason
    assert fp is not None and fp.kind is FailureKind.ABORTED and "client closed" in fp.reason
    assert "TransferRequest" not in kinds(w, "decode:1")
    assert d.views[12].releases == 1 and p.views[12].releases == 1


def test_requests_beyond_the_early_limit_are_refused_not_dropped() -> None:
    # the prefill engine has opened none of these rooms yet: the agent holds the first requests
    # (up to its bound of rooms) and refuses the next one at once, counted and with the reason
    w, p, d = pair()
    p.session._early.max_rooms = 2
    lay = d.session.layout
    dst = pages(3, offset=5)
    for room in (1, 2, 3):
        w.feed(d, ev.OpenReceiver(room, room, (("prefill:1", 0),)))
        w.feed(d, ev.ReceiverInit(room, room, {r.name: dst for r in lay.regions}, SEQ, 0))
    w.run()
    assert d.views[3].state is KVPoll.Failed
    f = d.views[3].failure
    assert f is not None and f.kind is FailureKind.ADMISSION and "not opened yet" in f.reason
    assert p.session.counters["early_dropped"] == 1
    assert KVPoll.Failed not in (d.views[1].state, d.views[2].state)
    # the held ones go ahead once the engine opens them
    src = pages(3)
    w.feed(p, ev.OpenSender(1, 1, {r.name: src for r in lay.regions}, SEQ, 1))
    for lid in layers(lay):
        w.feed(p, ev.LayerReady(1, 1, lid))
    w.run()
    assert d.views[1].state is KVPoll.Success


def written_while_decode_holds(room: int) -> tuple[MemoryWire, Side, Side]:
    """A pair whose prefill wrote every layer of `room` and sent its LayerDones, which wait
    unread in the decode's socket (held) until the test releases them."""
    w, p, d = pair()
    open_room(w, p, d, room)
    w.run()
    w.hold(lambda f, t, m: t == "decode:1")  # what the prefill says waits in the socket
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(room, room, lid))
    w.run()
    assert "LayerDone" in kinds(w, "prefill:1")
    return w, p, d


def assert_failed_unread(w: MemoryWire, d: Side, room: int, why: str) -> None:
    """The woken decode failed `room` as its prefill did, without acking what it read."""
    w.release_held()
    w.run()
    f = d.views[room].failure
    assert d.views[room].state is KVPoll.Failed
    assert f is not None and f.kind is FailureKind.PEER_LOST and why in f.reason, f
    assert "RoomAck" not in kinds(w, "decode:1")
    assert d.session.counters["rechecks"] == 1 and d.session.counters["rechecks_passed"] == 0


def assert_kept_by_both(p: Side, d: Side, room: int) -> None:
    """`room` ended Success on both sides, byte-exact; each side asked once and was told yes,
    and nobody was declared lost."""
    assert d.views[room].state is KVPoll.Success and p.views[room].state is KVPoll.Success
    assert bad_bytes(d) == 0
    for s in (p, d):
        assert s.session.counters["rechecks"] == s.session.counters["rechecks_passed"] == 1
        assert s.session.counters["peers_lost"] == 0


def probes(w: MemoryWire, frm: str) -> list[int]:
    """The probes `frm` sent, delivered or dropped."""
    sent = [m[1] if isinstance(m, tuple) else m for f, _, m in w.sent if f == frm]
    return [m.probe for m in sent if isinstance(m, P.Heartbeat) and m.probe]


def test_a_woken_agent_whose_peer_gave_it_up_fails_its_rooms_before_reading() -> None:
    """A decode frozen while every layer and LayerDone reached it, its prefill awake: the
    prefill hears nothing for 2 heartbeats, gives it up and fails the room. Woken (its next
    event comes more than 2 heartbeats after its last heartbeat), the decode asks the prefill
    whether it still holds it before reading the queued messages; told no, it fails the room
    unread: never a split outcome."""
    w, p, _ = written_while_decode_holds(7)
    d = w.sides["decode:1"]
    for _ in range(3):  # the prefill beats on; the decode's silence reaches 3 heartbeats
        w.clock.advance(HB)
        w.feed(p, ev.Tick(read_at=w.clock()))
    assert p.views[7].state is KVPoll.Failed
    assert_failed_unread(w, d, 7, "dropped its handshake")
    assert len(probes(w, "decode:1")) == 1


def test_an_agent_and_its_peer_starved_together_keep_their_rooms() -> None:
    """Both sides starved at once (one busy host): neither sent a heartbeat for 2.5
    heartbeats. Each, woken, asks the other whether it still holds it; each still does, so
    the room the decode held unread ends Success on both sides, byte-exact (it used to fail on
    both, the usual way a loaded host failed rooms)."""
    w, p, d = written_while_decode_holds(7)
    w.clock.advance(2.5 * HB)
    w.release_held()
    w.run()
    assert_kept_by_both(p, d, 7)
    # the decode asked before it acked: its probe went out ahead of its RoomAck
    sent = [m for f, _, m in w.sent if f == "decode:1"]
    first_probe = next(i for i, m in enumerate(sent) if isinstance(m, P.Heartbeat) and m.probe)
    assert first_probe < next(i for i, m in enumerate(sent) if isinstance(m, P.RoomAck))


def test_a_peer_that_asks_while_rechecked_is_waited_for_from_its_question() -> None:
    """Both sides starved, the decode far longer: the prefill wakes first and asks; the decode
    is still frozen when 2 heartbeats have passed since, then wakes and asks too. The prefill
    tells it yes, so its own wait for the decode's answer counts from that question: had it
    declared the decode lost on its first bound, right after telling it yes, the decode,
    reading on, would end Success a room its prefill failed (the simulator's seed 13733)."""
    w, p, d = written_while_decode_holds(7)
    w.clock.advance(2.5 * HB)
    w.feed(p, ev.Tick(read_at=w.clock()))  # the prefill wakes first and asks
    assert len(probes(w, "prefill:1")) == 1
    w.clock.advance(1.8 * HB)  # the decode still frozen: no answer
    w.feed(p, ev.Tick(read_at=w.clock()))
    w.feed(d, ev.Tick(read_at=w.clock()))  # the decode wakes and asks
    w.run()  # its question reaches the prefill, which answers (held for the decode)
    assert len(probes(w, "decode:1")) == 1
    w.clock.advance(HB)  # its next beat: 2.8 heartbeats since the prefill asked, 1 since it
    w.feed(p, ev.Tick(read_at=w.clock()))  # was asked
    assert not p.views[7].done, p.views[7].failure
    w.release_held()  # the decode reads the prefill's question and answer, and answers
    w.run()
    assert_kept_by_both(p, d, 7)


def test_a_failed_that_says_its_sender_dropped_this_agent_fails_every_room_with_it() -> None:
    """The decode runs, but its heartbeats no longer reach its prefill, which declares it lost
    and fails both rooms with it. The first `Failed` to arrive says so (`dropped_gen`): the decode
    fails the other room at once, without waiting for that room's own `Failed` (here never
    delivered), which is still on the way while the decode could end it Success (the
    simulator's seed 22452)."""
    w, p, d = pair()
    for room in (7, 8):
        open_room(w, p, d, room)
    w.run()
    w.drop(lambda f, t, m: f == "decode:1" or isinstance(m, P.Failed) and m.room == 8)
    for _ in range(3):  # 3 heartbeats: the prefill hears nothing from the decode
        w.clock.advance(HB)
        w.feed(p, ev.Tick(read_at=w.clock()))
        w.feed(d, ev.Tick(read_at=w.clock()))
        w.run()
    assert p.views[7].state is KVPoll.Failed and p.views[8].state is KVPoll.Failed
    sent = [m for f, _, m in w.sent if f == "prefill:1" and isinstance(m, P.Failed)]
    assert sent and all(m.dropped_gen == d.session.ctx.me.generation for m in sent)
    for room in (7, 8):
        assert d.views[room].state is KVPoll.Failed, (room, d.views[room])
    f = d.views[8].failure
    assert f is not None and f.kind is FailureKind.PEER_LOST
    assert "dropped its handshake with this agent" in f.reason, f


def test_a_recheck_nobody_answers_declares_the_peer_lost() -> None:
    """The woken decode's question never reaches its prefill: 2 heartbeats after asking, it
    declares the prefill lost and fails the room it held unread."""
    w, _, d = written_while_decode_holds(7)
    w.clock.advance(2.5 * HB)
    w.drop(lambda f, t, m: f == "decode:1")
    w.release_held()
    w.run()
    assert not d.views[7].done  # what its prefill said waits for the answer
    for _ in range(3):
        w.clock.advance(HB)
        w.feed(d, ev.Tick(read_at=w.clock()))
    w.run()
    f = d.views[7].failure
    assert d.views[7].state is KVPoll.Failed
    assert f is not None and f.kind is FailureKind.PEER_LOST and "did not say" in f.reason
    assert f"unresponsive for {2.5 * HB:.2f}s" in f.reason
    assert d.session.counters["rechecks_passed"] == 0


def test_an_answer_to_another_probe_proves_nothing() -> None:
    """A heartbeat answering a probe other than the one out (an earlier recheck's, or made
    up) leaves the rechecked peer's room messages waiting."""
    w, p, d = written_while_decode_holds(7)
    w.clock.advance(2.5 * HB)
    w.drop(lambda f, t, m: f == "decode:1")  # the real question never arrives
    w.release_held()
    w.run()
    (probe,) = probes(w, "decode:1")
    w.feed(d, ev.MessageReceived(P.Heartbeat(src="prefill:1", gen=p.session.ctx.me.generation,
                                              rooms=[7], answers=probe + 1), None))
    assert not d.views[7].done and d.session.counters["rechecks_passed"] == 0
    w.feed(d, ev.MessageReceived(P.Heartbeat(src="prefill:1", gen=p.session.ctx.me.generation,
                                              rooms=[7], answers=probe), None))
    assert d.session.counters["rechecks_passed"] == 1
    w.run()  # what the prefill said is read now: the room lands
    assert d.views[7].state is KVPoll.Success and bad_bytes(d) == 0


def test_a_room_whose_bytes_are_checked_after_the_wake_waits_for_the_answer() -> None:
    """The decode read every LayerDone before its stall, but the completions that verify the
    last bytes (a receive, a hash) come after it: the room is not Success, and no RoomAck
    goes out, until its prefill answered that it still holds the decode (it may have given
    the room up meanwhile; seen in the simulator, `success-after-given-up`)."""
    w, p, d = pair()
    open_room(w, p, d, 7)
    w.run()
    for lid in layers(p.session.layout):
        w.feed(p, ev.LayerReady(7, 7, lid))
    later: list[ev.Event] = []  # the decode's completions, kept back
    while True:
        while w.completions:
            side, e = w.completions.popleft()
            if side is d:
                later.append(e)
            else:
                w.feed(side, e)
        if not w.step():
            w.feed(p, ev.Tick(read_at=w.clock()))  # batched LayerDones go out
            if not (w.messages or w.completions):
                break
    assert "LayerDone" in kinds(w, "prefill:1") and later
    assert d.views[7].state is not KVPoll.Success
    w.clock.advance(2.5 * HB)  # both stalled
    w.hold(lambda f, t, m: f == "prefill:1")  # the prefill's answer waits
    for e in later:
        w.feed(d, e)
    w.run()
    assert d.session.counters["rechecks"] == 1 and d.views[7].landed
    assert d.views[7].state is not KVPoll.Success and "RoomAck" not in kinds(w, "decode:1")
    w.release_held()
    w.run()
    assert d.views[7].state is KVPoll.Success and p.views[7].state is KVPoll.Success
    assert bad_bytes(d) == 0 and d.session.counters["rechecks_passed"] == 1


def answers(w: MemoryWire, frm: str) -> list[int]:
    return [m.answers for f, _, m in w.sent if f == frm and isinstance(m, P.Heartbeat)
            and m.answers]


def test_a_probe_is_answered_only_while_the_handshake_it_asks_about_stands() -> None:
    """A peer answers a woken agent's probe while it is matched with it; not while a new
    handshake is under way (it dropped that agent and said Hello again: the rooms of the old
    one are gone on its side), so the woken agent never reads on as if nothing happened."""
    w, p, d = pair()
    gen = p.session.ctx.me.generation
    w.drop(lambda f, t, m: f == "prefill:1")  # the prefill's HelloAck never comes
    w.feed(d, ev.OpenReceiver(3, 3, (("prefill:1", 0),)))
    w.run()
    assert d.session.peers["prefill:1"].state.phase.value == "hello_sent"
    w.feed(d, ev.MessageReceived(P.Heartbeat(src="prefill:1", gen=gen, rooms=[3], probe=5),
                                 None))
    assert answers(w, "decode:1") == []
    w2, p2, d2 = pair()
    open_room(w2, p2, d2, 4)
    w2.run()
    w2.feed(d2, ev.MessageReceived(P.Heartbeat(src="prefill:1",
                                               gen=p2.session.ctx.me.generation, rooms=[4],
                                               probe=5), None))
    assert answers(w2, "decode:1") == [5]


def test_silence_counts_from_the_last_heartbeat_sent_not_the_last_event() -> None:
    """The decode sent its heartbeat, handled one more event 0.9 heartbeat later (a Tick that
    sent nothing), then was stopped for 1.3 heartbeats while the room's LayerDones reached it:
    its peers heard nothing from it for 2.2 heartbeats and may have given it up, though its
    own last event is only 1.3 heartbeats old. Woken, it rechecks its prefill before reading
    (it took the event gap before, read the LayerDones and ended Success while its prefill had
    failed the room: a split outcome, seen with a real SIGSTOP)."""
    w, _, d = written_while_decode_holds(8)
    w.clock.advance(HB)
    heartbeats = kinds(w, "decode:1").count("Heartbeat")
    w.feed(d, ev.Tick(read_at=w.clock()))  # its heartbeat is due: sent
    assert kinds(w, "decode:1").count("Heartbeat") == heartbeats + 1
    w.clock.advance(0.9 * HB)
    w.feed(d, ev.Tick(read_at=w.clock()))  # no heartbeat due: none sent
    assert kinds(w, "decode:1").count("Heartbeat") == heartbeats + 1
    w.clock.advance(1.3 * HB)  # stopped
    w.drop(lambda f, t, m: f == "decode:1")
    w.release_held()
    w.run()
    assert d.session.counters["rechecks"] == 1
    assert not d.views[8].done and "RoomAck" not in kinds(w, "decode:1")
