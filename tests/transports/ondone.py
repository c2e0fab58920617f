"""An on_done callback for a transport op in the tests: records its error and sets an event."""

from __future__ import annotations

import threading


class Done:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.err: BaseException | None = None

    def __call__(self, exc: BaseException | None) -> None:
        self.err = exc
        self.event.set()
