"""Room timelines and their OpenTelemetry traces: what each room went through, and when.

Rules:
- Fed by the control loop alone: `observe(event, effects)` once per event the session handled,
  with the effects it returned. So it sees the runtime's room events and nothing else: a room
  opened, the bootstrap lookup's answer, the handshake messages (TransferRequest, then
  TransferAccepted), layers (the engine's LayerReady, LayerDone messages, the landed layers of
  RoomUpdate), retransmit requests (LayerNack) and the room's end (RoomUpdate done). It never
  reads the session, and the session does not know it exists. A room's end is stamped when
  observed; its figures and spans are made by `settle()`, which the loop calls once the
  event's effects ran (the engine sees the room's end before its trace is written).
- One `RoomTimeline` per open room, times in ns since the epoch (`time.time_ns`, the clock of
  OpenTelemetry spans); at its end the sink sees it and the last `KEEP` are kept for
  `timings(room)`, the per-request figures of the demo's and bench's JSON. Spans and those
  figures come from the same timeline.
- OpenTelemetry only with the otel extra (opentelemetry-api): `RoomTimelines` looks for it
  without importing it and imports it only when it is installed; without it rooms are still
  timed and nothing of opentelemetry is imported. With it, each side of a room is one span
  ``kvhandoff.room`` with child spans ``kvhandoff.bootstrap_lookup`` (a decode that asked the
  bootstrap server), ``kvhandoff.handshake`` (one per leg), ``kvhandoff.layers`` (one event per
  layer up to `LAYER_EVENTS` layers, else one summary event) and ``kvhandoff.tail`` (the
  engine's last layer to the room's end), and on failure a ``kvhandoff.failure`` event with the
  span's status ERROR. The prefill's room span starts when the room opens, under the context
  that was current on the engine thread that opened it; its context goes to the decode in
  `TransferAccepted.trace`, under which the decode's room span is made when its room ends
  (start time: when it opened), so both sides are one trace. A decode reading from several
  prefill ranks (another TP size) gets one context per leg: its room span is a child of the
  first rank's in the route's order and links to the others' (each rank's span roots its own
  trace, unless a span was current on the engine thread). The engine's request id is the
  attribute ``kvhandoff.request_id``.
- Request timelines in the log, off unless `enable_marks()` was called (an engine integration
  does it when its config asks: vLLM's ``kv_connector_extra_config.timeline``): `mark(what,
  ...)` writes one line ``kvhandoff timeline {json}`` with ``time.time_ns()`` (one clock for
  every process of a host), and each room's timeline is one such line when it ends (``room``:
  its stamps, absolute). `make bench-live` reads them from the engines' logs and lays one
  request out across both engines. Off, `mark` is one flag test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from collections import OrderedDict
from typing import Any

import msgspec

from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import Effect, RoomUpdate, Send
from kvhandoff.state_machine import KVPoll, Role

log = logging.getLogger("kvhandoff.agent")

KEEP = 1024  # finished rooms whose timings `timings(room)` still answers
LAYER_EVENTS = 16  # up to this many layers: one span event each; more: one summary event
_NS_PER_MS = 1e6

_timeline_log = logging.getLogger("kvhandoff.timeline")
_marks = False  # set once by enable_marks(), read by every mark()


def enable_marks(on: bool = True) -> None:
    """Turns the request timeline lines on (or off) in this process (see the module rules)."""
    global _marks
    _marks = on


def marks_enabled() -> bool:
    return _marks


def mark(what: str, **fields: Any) -> None:
    """One timestamped step of a request (``what``: ``<side>.<step>``), when enabled."""
    if not _marks:
        return
    line = {"t_ns": time.time_ns(), "what": what, "pid": os.getpid(), **fields}
    _timeline_log.info("kvhandoff timeline %s", msgspec.json.encode(line).decode())


class RoomTimeline:
    """When one room on this side did what (ns since the epoch), and what it moved."""

    __slots__ = ("room", "role", "request_id", "opened_ns", "lookup", "handshakes", "ready",
                 "layers", "done_ns", "state", "failure", "bytes", "retransmits", "one_sided",
                 "peers", "parents", "span", "landed")

    def __init__(self, room: int, role: Role, request_id: str | None, now_ns: int) -> None:
        self.room = room
        self.role = role
        self.request_id = request_id
        self.opened_ns = now_ns
        self.lookup: list[Any] = []  # [start, end or None, error or None]
        self.handshakes: dict[str, list[int | None]] = {}  # peer -> [start, end]
        self.ready: dict[int, int] = {}  # prefill: layer -> when the engine marked it
        self.layers: dict[int, int] = {}  # layer -> when it was sent (prefill) / landed
        self.done_ns: int | None = None
        self.state = KVPoll.Bootstrapping
        self.failure: Any = None  # errors.Failure
        self.bytes = 0
        self.retransmits = 0
        self.one_sided = False
        self.peers: tuple[str, ...] = ()  # decode: the prefill agents, in the route's order
        self.parents: dict[str, P.TraceContext] = {}  # decode: prefill agent -> room context
        self.span: Any = None  # prefill: its room span, open while the room is
        self.landed: frozenset[int] = frozenset()

    def __repr__(self) -> str:
        return f"RoomTimeline(room={self.room}, {self.role.value}, {self.state.name})"

    def tail_start_ns(self) -> int | None:
        """The engine's last layer mark (prefill) or the last landed layer (decode)."""
        marks = self.ready if self.role is Role.PREFILL else self.layers
        return max(marks.values()) if marks else None

    def timings(self) -> dict[str, Any]:
        """The room's figures in ms (None: the step did not happen), as JSON."""
        def ms(a: int | None, b: int | None) -> float | None:
            return None if a is None or b is None else round((b - a) / _NS_PER_MS, 3)

        hs = [h for h in self.handshakes.values() if h[1] is not None]
        f = self.failure
        return {
            "room": self.room, "role": self.role.value, "request_id": self.request_id,
            "state": self.state.name, "failure_kind": f.kind.value if f else None,
            "total_ms": ms(self.opened_ns, self.done_ns),
            "bootstrap_lookup_ms": ms(*self.lookup[:2]) if self.lookup else None,
            "handshake_ms": max((ms(h[0], h[1]) or 0.0 for h in hs), default=None),
            "layers_ms": ms(min(self.layers.values()), max(self.layers.values()))
            if self.layers else None,
            "tail_ms": ms(self.tail_start_ns(), self.done_ns),
            "layers": len(self.layers), "bytes": self.bytes, "retransmits": self.retransmits,
        }


class RoomTimelines:
    """The timelines of one agent's rooms (see the module rules). `observe` and `timings` run
    on the control thread; `engine_opened` on the engine thread that opens the room."""

    def __init__(self, *, role: Role, agent_id: str, transport: str) -> None:
        self.role = role
        self._open: dict[object, RoomTimeline] = {}  # by room view
        self._by_room: dict[int, RoomTimeline] = {}
        self._opening: dict[object, tuple[str | None, Any]] = {}  # view -> (request id, ctx)
        self._done: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._ending: list[RoomTimeline] = []  # ended, figures not made yet (settle)
        self.errors = 0
        self._otel: _OtelRooms | None = None
        if _otel_installed():
            try:
                self._otel = _OtelRooms(role=role, agent_id=agent_id, transport=transport)
            except ImportError as e:  # a broken install: rooms are timed, not traced
                log.warning("opentelemetry is installed but does not import (%s): rooms are "
                            "not traced", e)

    # ------------------------------------------------------------------ engine thread

    def engine_opened(self, view: object, request_id: str | None) -> None:
        """Called before the room's open event is posted: the request id, and the engine
        thread's trace context (the prefill room span's parent)."""
        ctx = self._otel.current() if self._otel is not None else None
        self._opening[view] = (request_id, ctx)

    # ------------------------------------------------------------------ control thread

    def timings(self, room: int) -> dict[str, Any] | None:
        """The figures of `room`: finished (one of the last KEEP), else so far, else None."""
        tl = self._by_room.get(room) or next((t for t in self._ending if t.room == room), None)
        return tl.timings() if tl is not None else self._done.get(room)

    def observe(self, event: ev.Event, effects: list[Effect]) -> list[Effect]:
        """Takes in one handled event and its effects; returns the effects to execute (a
        prefill's TransferAccepted gains the room's trace context). Never raises: a fault
        here is counted and logged, the room goes on."""
        try:
            return self._observe(event, effects, time.time_ns())
        except Exception:  # noqa: BLE001 - tracing must never break the control loop
            self.errors += 1
            if self.errors <= 3:
                log.exception("room tracing: error on %s", type(event).__name__)
            return effects

    def _observe(self, event: ev.Event, effects: list[Effect], now: int) -> list[Effect]:
        if isinstance(event, ev.OpenSender | ev.OpenReceiver):
            self._opened(event, now)
        elif isinstance(event, ev.PeersResolved):
            tl = self._open.get(event.token)
            if tl is not None and tl.lookup:
                tl.lookup[1:] = [now, event.error]
            if tl is not None:
                tl.peers = tuple(addr for addr, _ in event.peers)
        elif isinstance(event, ev.LayerReady | ev.Batch):
            for one in event.events if isinstance(event, ev.Batch) else (event,):
                if isinstance(one, ev.LayerReady):
                    tl = self._open.get(one.token)
                    if tl is not None:
                        tl.ready[one.layer] = now
        elif isinstance(event, ev.MessageReceived):
            self._received(event.msg, now)
        out = effects
        for i, eff in enumerate(effects):
            if isinstance(eff, Send):
                sent = self._sent(eff, now)
                if sent is not eff:
                    out = list(out) if out is effects else out
                    out[i] = sent
            elif isinstance(eff, RoomUpdate):
                self._updated(eff, now)
        return out

    def _opened(self, event: ev.OpenSender | ev.OpenReceiver, now: int) -> None:
        request_id, ctx = self._opening.pop(event.token, (None, None))
        old = self._by_room.get(event.room)
        if old is not None:  # a view the engine let go of without its end: forget it
            self._open.pop(next((v for v, t in self._open.items() if t is old), None), None)
        tl = RoomTimeline(event.room, self.role, request_id, now)
        if isinstance(event, ev.OpenReceiver):
            if event.peers is None:
                tl.lookup = [now, None, None]  # the route lookup runs from now
            else:
                tl.peers = tuple(addr for addr, _ in event.peers)
        self._open[event.token] = tl
        self._by_room[event.room] = tl
        if self._otel is not None and self.role is Role.PREFILL:
            tl.span = self._otel.start_room(tl, ctx)

    def _received(self, msg: Any, now: int) -> None:
        tl = self._by_room.get(getattr(msg, "room", -1))
        if tl is None:
            return
        if isinstance(msg, P.TransferRequest):  # prefill: a decode rank's leg begins
            tl.handshakes.setdefault(msg.src, [now, None])
        elif isinstance(msg, P.TransferAccepted):  # decode: the leg is accepted
            h = tl.handshakes.setdefault(msg.src, [None, None])
            h[1] = now
            tl.one_sided = msg.one_sided
            if msg.trace is not None and msg.trace.v == 1:
                tl.parents[msg.src] = msg.trace  # a leg accepted again counts once
        elif isinstance(msg, P.LayerDone):  # decode: layers the prefill finished
            tl.bytes += sum(r.nbytes for info in msg.layers for r in info.regions)
        elif isinstance(msg, P.LayerNack):  # prefill: the decode asks for a retransmit
            tl.retransmits += 1

    def _sent(self, eff: Send, now: int) -> Send:
        msg = eff.msg
        tl = self._by_room.get(getattr(msg, "room", -1))
        if tl is None:
            return eff
        if isinstance(msg, P.TransferRequest):  # decode: asks a prefill rank for the room
            tl.handshakes[eff.addr] = [now, None]
        elif isinstance(msg, P.TransferAccepted):  # prefill: the leg is accepted
            h = tl.handshakes.setdefault(eff.addr, [None, None])
            h[1] = now
            tl.one_sided = msg.one_sided
            trace = self._otel.context_of(tl.span) if self._otel is not None else None
            if trace is not None:
                return dataclasses.replace(eff, msg=msgspec.structs.replace(msg, trace=trace))
        elif isinstance(msg, P.LayerDone):  # prefill: layers written / sent
            for info in msg.layers:
                tl.layers[info.layer] = now
                tl.bytes += sum(r.nbytes for r in info.regions)
        elif isinstance(msg, P.LayerNack):  # decode: a layer did not verify
            tl.retransmits += 1
        return eff

    def _updated(self, eff: RoomUpdate, now: int) -> None:
        tl = self._open.get(eff.token)
        if tl is None:
            return
        tl.state, tl.failure = eff.state, eff.failure
        if self.role is Role.DECODE and eff.landed != tl.landed:
            for layer in eff.landed - tl.landed:
                tl.layers[layer] = now
            tl.landed = eff.landed
        if not eff.done:
            return
        tl.done_ns = now
        del self._open[eff.token]
        if self._by_room.get(tl.room) is tl:
            del self._by_room[tl.room]
        self._ending.append(tl)  # its figures and spans once the engine was told (settle)

    def settle(self) -> None:
        """(control thread, after the effects of an observed event were executed) The
        figures and spans of the rooms that ended in it: made after the engine saw the end
        (tens of microseconds a room, on the tail of every handoff otherwise). Never
        raises."""
        while self._ending:
            tl = self._ending.pop(0)
            try:
                if _marks:
                    _mark_room(tl)
                self._done[tl.room] = tl.timings()
                self._done.move_to_end(tl.room)
                while len(self._done) > KEEP:
                    self._done.popitem(last=False)
                if self._otel is not None:
                    self._otel.finish_room(tl)
            except Exception:  # noqa: BLE001 - tracing must never break the control loop
                self.errors += 1
                if self.errors <= 3:
                    log.exception("room tracing: error finishing room %d", tl.room)


def _mark_room(tl: RoomTimeline) -> None:
    """A room's stamps (ns since the epoch) as one timeline line."""
    def span(marks: dict[int, int]) -> list[int] | None:
        return [min(marks.values()), max(marks.values())] if marks else None

    mark(f"{tl.role.value}.room", room=tl.room, rid=tl.request_id, state=tl.state.name,
         opened=tl.opened_ns, lookup=tl.lookup[:2] or None,
         handshakes=list(tl.handshakes.values()), ready=span(tl.ready),
         layers=span(tl.layers), done=tl.done_ns, bytes=tl.bytes)


def _otel_installed() -> bool:
    """Whether opentelemetry can be imported, without importing it."""
    try:
        return importlib.util.find_spec("opentelemetry") is not None
    except (ImportError, ValueError):
        return False


def _layer_events(tl: RoomTimeline) -> list[tuple[str, int, dict[str, Any]]]:
    """One ``kvhandoff.layer`` event per layer (sent or landed) in time order, or, past
    LAYER_EVENTS layers, one ``kvhandoff.layers_summary`` event at the last one."""
    order = sorted(tl.layers.items(), key=lambda kv: kv[1])
    if len(order) <= LAYER_EVENTS:
        return [("kvhandoff.layer", ts, {"kvhandoff.layer": layer}) for layer, ts in order]
    gaps = [(b - a) / _NS_PER_MS for (_, a), (_, b) in zip(order, order[1:], strict=False)]
    return [("kvhandoff.layers_summary", order[-1][1], {
        "kvhandoff.layers": len(order), "kvhandoff.first_layer": order[0][0],
        "kvhandoff.last_layer": order[-1][0],
        "kvhandoff.span_ms": round((order[-1][1] - order[0][1]) / _NS_PER_MS, 3),
        "kvhandoff.max_gap_ms": round(max(gaps), 3)})]


class _OtelRooms:
    """The rooms' spans through the OpenTelemetry API (imported here, on first use): the
    process's global TracerProvider decides where they go (none set: nothing is recorded)."""

    def __init__(self, *, role: Role, agent_id: str, transport: str) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._context = context
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._tracer = trace.get_tracer("kvhandoff")
        self._attrs = {"kvhandoff.role": role.value, "kvhandoff.agent_id": agent_id,
                       "kvhandoff.transport": transport}

    def current(self) -> Any:
        return self._context.get_current()

    def _room_attrs(self, tl: RoomTimeline) -> dict[str, Any]:
        attrs: dict[str, Any] = {**self._attrs, "kvhandoff.room": tl.room}
        if tl.request_id is not None:
            attrs["kvhandoff.request_id"] = tl.request_id
        return attrs

    def start_room(self, tl: RoomTimeline, ctx: Any) -> Any:
        """The prefill's room span, open from now (its context goes to the decode)."""
        return self._tracer.start_span("kvhandoff.room", context=ctx or self._context.Context(),
                                       start_time=tl.opened_ns, attributes=self._room_attrs(tl))

    def context_of(self, span: Any) -> P.TraceContext | None:
        if span is None or not span.get_span_context().is_valid:
            return None  # no SDK (a no-op span): nothing to carry
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        if "traceparent" not in carrier:
            return None
        return P.TraceContext(1, carrier["traceparent"], carrier.get("tracestate", ""))

    def _parent(self, trace: P.TraceContext) -> Any:
        carrier = {"traceparent": trace.traceparent}
        if trace.tracestate:
            carrier["tracestate"] = trace.tracestate
        return self._propagator.extract(carrier, context=self._context.Context())

    def finish_room(self, tl: RoomTimeline) -> None:
        from opentelemetry.trace import Link, Status, StatusCode

        end = tl.done_ns or time.time_ns()
        span = tl.span
        if span is None:  # decode: made now, under the first prefill rank's room span (in
            # the route's order, not the order the legs were accepted in), linked to the others'
            order = {addr: i for i, addr in enumerate(tl.peers)}
            ctxs = [c for _, c in sorted(tl.parents.items(),
                                         key=lambda kv: order.get(kv[0], len(order)))]
            parent = self._parent(ctxs[0]) if ctxs else self._context.Context()
            links = [Link(self._trace.get_current_span(self._parent(p)).get_span_context())
                     for p in ctxs[1:]]
            span = self._tracer.start_span("kvhandoff.room", context=parent, links=links,
                                           start_time=tl.opened_ns,
                                           attributes=self._room_attrs(tl))
        if not span.is_recording():  # no SDK, or sampled out: no children to make
            span.end(end_time=end)
            return
        inside = self._trace.set_span_in_context(span)

        def child(name: str, start: int | None, stop: int | None, attrs: dict[str, Any],
                  events: list[tuple[str, int, dict[str, Any]]] | None = None) -> None:
            c = self._tracer.start_span(name, context=inside, start_time=start or tl.opened_ns,
                                        attributes={k: v for k, v in attrs.items()
                                                    if v is not None})
            for ename, ts, eattrs in events or ():
                c.add_event(ename, attributes=eattrs, timestamp=ts)
            if stop is None:  # the step never ended: the room's end ended it
                c.set_status(Status(StatusCode.ERROR, "did not complete"))
            c.end(end_time=stop or end)

        if tl.lookup:
            child("kvhandoff.bootstrap_lookup", tl.lookup[0], tl.lookup[1],
                  {"kvhandoff.error": tl.lookup[2]})
        for peer, (start, stop) in tl.handshakes.items():
            child("kvhandoff.handshake", start, stop, {"kvhandoff.peer": peer})
        if tl.layers:
            child("kvhandoff.layers", min(tl.layers.values()), max(tl.layers.values()),
                  {"kvhandoff.layers": len(tl.layers), "kvhandoff.bytes": tl.bytes,
                   "kvhandoff.retransmits": tl.retransmits}, _layer_events(tl))
        tail = tl.tail_start_ns()
        if tail is not None:
            child("kvhandoff.tail", tail, end, {})
        f = tl.failure
        span.set_attributes({"kvhandoff.state": tl.state.name, "kvhandoff.bytes": tl.bytes,
                             "kvhandoff.layers": len(tl.layers),
                             "kvhandoff.retransmits": tl.retransmits,
                             "kvhandoff.one_sided": tl.one_sided})
        if f is not None:
            span.add_event("kvhandoff.failure", timestamp=end, attributes={
                k: v for k, v in {"kvhandoff.failure_kind": f.kind.value,
                                  "kvhandoff.reason": f.reason, "kvhandoff.remote": f.remote,
                                  "kvhandoff.layer": f.layer,
                                  "kvhandoff.region": f.region}.items() if v is not None})
            span.set_attributes({"kvhandoff.failure_kind": f.kind.value})
            span.set_status(Status(StatusCode.ERROR, f"{f.kind.value}: {f.reason}"))
        span.end(end_time=end)
