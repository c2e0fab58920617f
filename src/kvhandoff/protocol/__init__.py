"""protocol — the transfer protocol of one agent, sans-IO: no socket, no thread, no clock.

`session.TransferSession` takes events (`events`) with the time passed in and returns effects
(`effects`). It holds owned parts, each with its own state: `context` (identity, settings, the
call's time, effects out, timers, counters), `lifecycle` (the room table: rooms, legs, how a
room ends and when its pages go back), `peers` (the peer table and the handshake), `inflight`
(the transport ops and hashing jobs in flight), `send` / `receive` (the prefill's and the
decode's data path), `chunks` (chunked prefill) and `reports` (status figures). `wire` holds
the versioned msgpack messages two agents exchange, `roomstate` a room's state in one place
(`RoomState`: its phase, failure, expected legs; per leg a `LegState`: machine, phase, fence,
failure), `rooms` a room and its legs as the data path uses them, `peerstate` a peer's
record and where its handshake stands (`PeerState`), `handshake` this agent's `Identity` and
the checks of a peer's Hello, `checksums` the checksum policy, `admission` a request's
admission, `planning` the span plans, `failures` the mapping to typed failures. Nothing
under this folder imports zmq, a transport, threading or a clock (a test reads every module
of the folder to hold that). It may import `buffers`; `buffers` never imports it
(`tests/unit/buffers/test_layers.py`).
"""
