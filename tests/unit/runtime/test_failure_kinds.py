"""Every `FailureKind` reaches the engine typed: `wait_for_layer` on a failed room raises the
kind's `RoomFailed` subclass (with its details), and `failure_kind` / `failure` say the same.
One test per kind, each provoking the failure for real (two agents, in-process transport,
faults from `kvhandoff.testing.faults`)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable

import pytest
import zmq

from kvhandoff import errors as E
from kvhandoff.errors import Failure, FailureKind
from kvhandoff.protocol import wire as P
from kvhandoff.state_machine import KVPoll

from .conftest import WAIT_S, Pair, layers_of, tiny_layout

MakePair = Callable[..., Pair]
SEQ = 100


def _raises(rv, cls: type[E.RoomFailed], kind: FailureKind) -> E.RoomFailed:  # type: ignore[no-untyped-def]
    assert rv.wait(WAIT_S) is KVPoll.Failed
    with pytest.raises(cls) as err:
        rv.wait_for_layer(0, WAIT_S)
    assert err.value.kind is kind and rv.failure_kind is kind
    assert err.value.room == rv.room and err.value.reason == rv.failure
    return err.value


def test_every_kind_has_its_own_error_class() -> None:
    classes = {k: type(Failure(k, "x").error(1)) for k in FailureKind}
    assert len(set(classes.values())) == len(FailureKind)
    assert all(issubclass(c, E.RoomFailed) for c in classes.values())
    assert issubclass(classes[FailureKind.DEADLINE], E.TransferTimeout)
    assert issubclass(classes[FailureKind.TRANSPORT], E.TransportError)


def test_layout_mismatch(pair: MakePair) -> None:
    pr = pair(tiny_layout(indexer=(0, 3, 5)), decode_layout=tiny_layout(indexer=(0, 2, 5)))
    _, rv, _, _ = pr.open(1, SEQ)
    err = _raises(rv, E.LayoutMismatch, FailureKind.LAYOUT_MISMATCH)
    assert "indexer_k.layer_ids: prefill=[0, 3, 5] decode=[0, 2, 5]" in err.diff  # type: ignore[attr-defined]


def test_checksum(pair: MakePair) -> None:
    pr = pair(decode_faults={"corrupt": [{"layer": 3, "region": "indexer_k", "times": 2}]})
    s, rv, _, _ = pr.open(2, SEQ)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    err = _raises(rv, E.ChecksumMismatch, FailureKind.CHECKSUM)
    assert (err.layer, err.region) == (3, "indexer_k")  # type: ignore[attr-defined]
    assert s.wait(WAIT_S) is KVPoll.Failed and s.failure_kind is FailureKind.CHECKSUM
    assert s.error is not None and s.error.remote


def test_peer_lost(pair: MakePair) -> None:
    # the prefill sends no heartbeats and no layer is ready: it is silent, the decode drops it
    pr = pair(prefill_faults={"refuse_heartbeats": True})
    _, rv, _, _ = pr.open(3, SEQ)
    err = _raises(rv, E.PeerLost, FailureKind.PEER_LOST)
    assert "silent" in err.reason


def test_aborted(pair: MakePair) -> None:
    pr = pair()
    s, rv, _, _ = pr.open(4, SEQ)
    s.abort("engine evicted it")
    err = _raises(rv, E.Aborted, FailureKind.ABORTED)
    assert "engine evicted it" in err.reason
    assert s.failure_kind is FailureKind.ABORTED


def test_deadline(pair: MakePair) -> None:
    # the prefill never computes a layer: the decode's WaitingForInput deadline expires
    pr = pair(decode_settings={"waiting_timeout_s": 0.3})
    _, rv, _, _ = pr.open(5, SEQ)
    err = _raises(rv, E.DeadlineExpired, FailureKind.DEADLINE)
    assert isinstance(err, E.TransferTimeout)
    assert err.deadline == "waiting_for_input"  # type: ignore[attr-defined]


def test_remote_failed(pair: MakePair) -> None:
    """A peer that fails a room without naming a kind (an older agent): REMOTE_FAILED."""
    pr = pair()
    s, rv, _, _ = pr.open(6, SEQ)
    s.layer_ready(0)
    assert rv.wait_for_layer(0, WAIT_S)
    pa, da = pr.prefill.agent, pr.decode.agent
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{da.address}")
    try:  # as the prefill would say it, without failure_kind
        sock.send_multipart(P.encode(P.Failed(src=pa.address, gen=pa.generation, room=6,
                                              reason="old prefill gave up")))
        err = _raises(rv, E.RemoteFailed, FailureKind.REMOTE_FAILED)
    finally:
        sock.close(0)
    assert "old prefill gave up" in err.reason and err.failure.remote
    s.abort("test over")


def test_invalid_request(pair: MakePair) -> None:
    pr = pair()
    p, d = pr.prefill, pr.decode
    src = p.pool.alloc(-(-SEQ // 16))
    s = p.agent.sender(7, pages=src, seq_len=SEQ, on_release=p.releases.callback(src))
    dst = d.pool.alloc(-(-(SEQ + 16) // 16))
    rv = d.agent.receiver(7, peer=p.agent.address, on_release=d.releases.callback(dst))
    rv.init(dst, SEQ + 16)  # the decode thinks the request is longer
    err = _raises(rv, E.InvalidRequest, FailureKind.INVALID_REQUEST)
    assert "seq_len: prefill=100 decode=116" in err.reason
    assert s.wait(WAIT_S) is KVPoll.Failed and s.failure_kind is FailureKind.INVALID_REQUEST


def test_transport(pair: MakePair) -> None:
    pr = pair(prefill_faults={"fail_layers": [2]})
    s, rv, _, _ = pr.open(8, SEQ)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    assert s.wait(WAIT_S) is KVPoll.Failed
    assert s.failure_kind is FailureKind.TRANSPORT and "send of layer 2" in (s.failure or "")
    _raises(rv, E.TransportFailed, FailureKind.TRANSPORT)


class _NoRoute(http.server.BaseHTTPRequestHandler):
    """A bootstrap server that knows no room: every lookup is a 404."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.dumps({"detail": "room 9: no such room"}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_bootstrap(pair: MakePair) -> None:
    pr = pair()
    server = http.server.HTTPServer(("127.0.0.1", 0), _NoRoute)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        rv = pr.decode.agent.receiver(9, f"127.0.0.1:{server.server_address[1]}")
        err = _raises(rv, E.BootstrapFailed, FailureKind.BOOTSTRAP)
    finally:
        server.shutdown()
        server.server_close()
    assert "bootstrap lookup failed" in err.reason and isinstance(err, E.BootstrapError)
