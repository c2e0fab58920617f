"""`EarlyMessages`: the control messages for rooms this agent's engine has not opened yet.

A decode often sends its `TransferRequest` before the prefill's engine has opened the room (the
two engines got the request at about the same time); an `Abort` may come before it too. Such
messages are kept until the engine opens the room (`pop`), or for a while (`collect`).

What is kept is bounded three ways, each past the reach of a sender that is not a peer: rooms
(`max_rooms`), messages per room (`per_room`) and bytes in all (`max_bytes`, each message
weighed as encoded). Without a shared secret any local process can send well-typed messages
naming rooms; counted only, 4,096 rooms of 16 messages of up to `max_message_bytes` each could
be held (about a tebibyte at the default 16 MiB); weighed, never more than `max_bytes`. A
message that does not fit is refused (`add` returns False): the session counts it and tells
its sender (never dropped silently).

Pure: no clock of its own (`now` is given), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.protocol import wire as P

EARLY_ROOMS = 4096  # rooms the engine has not opened yet whose messages are kept
EARLY_PER_ROOM = 16  # messages kept per such room (a request, an abort: a few at most)
# bytes of such messages kept in all: a TransferRequest of a 128K-token context names a few
# thousand pages per region (tens of KB), so 4,096 honest ones fit with room to spare
EARLY_BYTES = 256 << 20


@dataclass
class _Held:
    since: float
    msgs: list[tuple[P.Message, int]] = field(default_factory=list)


class EarlyMessages:
    """Messages per room, held until the room opens; bounded in rooms, per room and bytes."""

    def __init__(self, *, max_rooms: int = EARLY_ROOMS, per_room: int = EARLY_PER_ROOM,
                 max_bytes: int = EARLY_BYTES) -> None:
        self.max_rooms, self.per_room, self.max_bytes = max_rooms, per_room, max_bytes
        self._rooms: dict[int, _Held] = {}
        self.nbytes = 0  # what the held messages weigh, encoded

    def __len__(self) -> int:
        return len(self._rooms)

    def held(self, room: int) -> list[P.Message]:
        """The messages held for `room`, oldest first (a copy)."""
        h = self._rooms.get(room)
        return [m for m, _ in h.msgs] if h is not None else []

    def add(self, room: int, msg: P.Message, now: float) -> bool:
        """Keeps `msg` for `room`; False (nothing kept) where a bound would be passed."""
        h = self._rooms.get(room)
        if h is None and len(self._rooms) >= self.max_rooms:
            return False
        if h is not None and len(h.msgs) >= self.per_room:
            return False
        size = sum(len(f) for f in P.encode(msg))
        if self.nbytes + size > self.max_bytes:
            return False
        if h is None:
            h = self._rooms[room] = _Held(since=now)
        h.msgs.append((msg, size))
        self.nbytes += size
        return True

    def pop(self, room: int) -> list[P.Message]:
        """The messages held for `room` (oldest first), no longer held."""
        h = self._rooms.pop(room, None)
        if h is None:
            return []
        self.nbytes -= sum(n for _, n in h.msgs)
        return [m for m, _ in h.msgs]

    def drop_requests(self, room: int, src: str) -> None:
        """Forgets `src`'s transfer requests for `room` (it failed or aborted the room)."""
        h = self._rooms.get(room)
        if h is None:
            return
        keep = [(m, n) for m, n in h.msgs
                if not (isinstance(m, P.TransferRequest) and m.src == src)]
        self.nbytes -= sum(n for _, n in h.msgs) - sum(n for _, n in keep)
        h.msgs = keep

    def collect(self, now: float, keep_s: float) -> None:
        """Forgets the rooms held longer than `keep_s` (never opened)."""
        for room in [r for r, h in self._rooms.items() if now - h.since > keep_s]:
            self.pop(room)
