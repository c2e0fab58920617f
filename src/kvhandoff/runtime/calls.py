"""`ThreadPeerCalls`: production's peer-call workers (the `calls` part of an
`runtime.executor.Executor`).

A transport call that may wait on its peer (connect, register_remote, cancel, disconnect) never
runs on the control thread: it goes to a small thread pool and the events it returns are posted
back. Each peer's calls run one at a time, in the order the session asked for them (a cancel
never overtakes its connect); the control thread alone keeps the per-peer queues (`run`,
`next_calls`), the workers only hand back the peer whose call ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvhandoff.protocol import events as ev
from kvhandoff.runtime.executor import Call

PEER_CALL_WORKERS = 4  # peers whose blocking transport calls run at once


class ThreadPeerCalls:
    """Peer calls on a thread pool (see the module doc). `post` hands a call's events back
    (any thread); `wake` wakes the control thread once a call ended."""

    def __init__(self, *, post: Callable[[ev.Event], None], wake: Callable[[], None]) -> None:
        self._post = post
        self._wake = wake
        self._pool = ThreadPoolExecutor(max_workers=PEER_CALL_WORKERS,
                                        thread_name_prefix="kvh-peer-call")
        self._waiting: dict[str, deque[Call]] = {}  # control thread only
        self._done: deque[str] = deque()  # peers whose call ended (workers append)

    @property
    def ended(self) -> bool:
        """Whether a call ended whose peer's next call is still to start (`next_calls`)."""
        return bool(self._done)

    def run(self, peer: str, call: Call) -> None:
        """(control thread) Runs `call` on the pool after `peer`'s earlier calls."""
        waiting = self._waiting.get(peer)
        if waiting is not None:
            waiting.append(call)
            return
        self._waiting[peer] = deque()
        self._start(peer, call)

    def next_calls(self) -> None:
        """(control thread) Starts each peer's next call once its previous one ended."""
        while self._done:
            peer = self._done.popleft()
            waiting = self._waiting.get(peer)
            if waiting:
                self._start(peer, waiting.popleft())
            else:
                self._waiting.pop(peer, None)

    def close(self) -> None:
        """A call still waiting on its peer ends when the agent closes the transport."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, peer: str, call: Call) -> None:
        def go() -> None:
            try:
                for event in call():
                    self._post(event)
            finally:
                self._done.append(peer)
                self._wake()

        try:
            self._pool.submit(go)
        except RuntimeError:  # the pool shut down: the agent is closing
            self._waiting.pop(peer, None)
