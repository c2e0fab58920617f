"""protocol — the transfer protocol of one agent, sans-IO: no socket, no thread, no clock.

`session.TransferSession` takes events (`events`) with the time passed in and returns effects
(`effects`). It holds owned parts, each with its own state: `context` (identity, settings, the
call's time, effects out, timers, counters), `lifecycle` (the room table: rooms, legs, how a
room ends and when its pages go back), `peers` (the peer table and the handshake), `datapath`
(plans, posts, completions, checksums), `chunks` (chunked prefill) and `reports` (status
figures). `wire` holds the versioned msgpack messages two agents exchange, `handshake` the
Hello checks, `rooms` a room's legs, `failures` the mapping to typed failures. Nothing under
this folder imports zmq, a transport, threading or a clock (a test reads every module of the
folder to hold that).
"""
