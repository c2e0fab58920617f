# A completion thread: runs queued callables in order, so that on_done callbacks always come from
# the transport's own thread and never from inside post_* / cancel (the caller may hold locks).
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class CallbackThread:
    """One daemon thread running queued callables; `stop()` drains the queue and joins."""

    __slots__ = ("_queue", "_thread", "_stopped")

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a caller's callback must not kill the transport
                log.exception("transport callback raised")

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._queue.put(None)
        if not self.in_thread():
            self._thread.join()
