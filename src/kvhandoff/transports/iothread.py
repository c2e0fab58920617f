# The I/O thread of a transport (tcp, ucx, shm): the thread, its command queue and the pipe
# that wakes it. A command is one of the transport's own methods with its arguments (the
# command set is the transport's: `put(self._on_send, op)`); the thread only carries them.
#
# Rules: only the I/O thread reads the queue (`handle`); other threads `put` a command and
# write a byte to the wake pipe, and only while the thread may be asleep (`asleep`: a loop
# that sets it False while awake sets it True again before its last look at the queue, and
# polls without a timeout when a command is queued, so none is left waiting; a loop that
# never sets it has every command wake it). `stop` is the thread's own command, not one of the
# transport's: `handle` runs nothing after it and sets `stopped`, and the loop returns.
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


def _stop() -> None:
    """The thread's own command: the loop returns (never called)."""


class IoThread:
    """One I/O thread with its command queue and wake pipe (see module comment)."""

    __slots__ = ("_name", "_commands", "asleep", "stopped", "_wake_r", "_wake_w", "_thread",
                 "_closed")

    def __init__(self, name: str) -> None:
        self._name = name
        self._commands: deque[tuple[Any, ...]] = deque()
        self.asleep = True  # the thread may be in poll (see module comment)
        self.stopped = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def wake_fd(self) -> int:
        """The read end of the wake pipe, for the loop's poller."""
        return self._wake_r

    def start(self, run: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=run, daemon=True, name=self._name)
        self._thread.start()

    def is_current(self) -> bool:
        """Whether the caller runs on this I/O thread."""
        return threading.current_thread() is self._thread

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pending(self) -> bool:
        """Whether a command is queued."""
        return bool(self._commands)

    def put(self, cmd: Callable[..., object], *args: Any) -> None:
        """Queues `cmd(*lead, *args)` for the thread (any thread; `lead`: what the loop
        passes to every command, see `handle`) and wakes it if it may be asleep."""
        self._commands.append((cmd, *args))
        if not self.asleep:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the I/O thread is awake anyway

    def drain_wake(self) -> None:
        """(I/O thread) Empties the wake pipe."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def handle(self, *lead: Any) -> int:
        """(I/O thread) Runs the queued commands in order, `cmd(*lead, *args)`; how many
        ran. At a stop it runs nothing more and sets `stopped`."""
        ran = 0
        while self._commands:
            cmd, *args = self._commands.popleft()
            if cmd is _stop:
                self.stopped = True
                return ran
            cmd(*lead, *args)
            ran += 1
        return ran

    def stop(self, *also: Any) -> None:
        """Asks the thread to stop and joins it (unless called on it), then stops each of
        `also` (anything with a stop(): the transport's other workers, in order) and closes
        the wake pipe."""
        self._commands.append((_stop,))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        if self._thread is not None and not self.is_current():
            self._thread.join()
        for worker in also:
            worker.stop()
        self.close()

    def close(self) -> None:
        """Closes the wake pipe (the end of `stop`, or for a transport whose constructor
        failed before the thread started). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)
