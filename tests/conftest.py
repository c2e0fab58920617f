"""The whole run: a watchdog for stalls of the test process itself.

Several loopback tests run real servers as threads of the test process (uvicorn, agents). If
one thread keeps the GIL in C code for seconds, or the process is not scheduled at all, every
one of those servers goes silent at once, and a test fails far from the cause. So, for the
whole run, a daemon thread re-arms `faulthandler.dump_traceback_later`
every 0.5 s. If no Python code can run for `STALL_S`, faulthandler's own C thread, which needs
no GIL, writes every thread's stack to a file: the thread that held the GIL shows where it was.
When the heartbeat runs again it notes the stall's length and the test that was running; a
stall that left no stacks means the whole process was not running (stopped, or the machine
starved it). Each stall also says what the machine was doing: the process's major page faults
during it (pages read back from disk), the load average and the memory available. The run's
summary lists the stalls; nothing is printed when there were none.

Garbage collections are timed too (`gc.callbacks`): one that takes `GC_SLOW_S` or more is
listed with its test. A finaliser that blocks shows up there, though the GIL is free meanwhile:
that was the cause of the stalls seen in full runs (an in-process bootstrap server that left a
request unanswered for 30 s in CI, 2 s tests that took 120 s): a zmq context of an SGLang
manager, terminated by the collector while its sockets were open, blocked the collecting
thread until pytest-timeout's alarm broke it, and the test still passed.

The collector's pauses themselves: with torch, SGLang and vLLM imported, a full collection of
this process took 1.0-2.0 s on a 2-core host, and every thread of the process (the agents'
control threads of a test with a 0.2 s heartbeat among them) waits for it: two tests failed
as a lost peer ("unresponsive for 1.38 s"). So what is alive once the tests are collected,
and again after a test module whose run imported many more modules, is collected once and
then frozen (`gc.freeze`): later collections no longer walk the modules' objects. Objects
frozen that die later are still freed by their reference counts.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import resource
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

STALL_S = 4.0
BEAT_S = 0.5
GC_SLOW_S = 1.0


class _Watchdog:
    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(mode="w+", prefix="kvhandoff-stalls-")
        self.test = "(between tests)"
        self.stalls: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-stall-watchdog",
                                        daemon=True)
        self._gc_started: dict[int, float] = {}  # by thread: a collection runs in the thread
        # whose allocation set it off

    def start(self) -> None:
        self._thread.start()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._gc_started[me] = time.monotonic()
            return
        began = self._gc_started.pop(me, None)
        if began is None:
            return
        took = time.monotonic() - began
        if took >= GC_SLOW_S:
            self.stalls.append(f"a garbage collection (generation {info.get('generation')}, "
                               f"{info.get('collected')} collected) took {took:.1f} s in "
                               f"thread {threading.current_thread().name}, during {self.test}")

    def _run(self) -> None:
        last = time.monotonic()
        dumped = 0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        while not self._stop.is_set():
            faulthandler.dump_traceback_later(STALL_S, file=self.file)
            self._stop.wait(BEAT_S)
            now = time.monotonic()
            gap, last = now - last, now
            faults, before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, faults
            if gap < STALL_S:
                continue
            self.file.flush()
            size = self.file.seek(0, 2)
            how = ("every thread's stack below" if size > dumped else
                   "no stacks: the whole process did not run")
            dumped = size
            self.stalls.append(f"{gap:.1f} s without Python running, during {self.test} "
                               f"({how}; {faults - before} major page faults, {_machine()})")
        faulthandler.cancel_dump_traceback_later()

    def stop(self) -> str:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        self._thread.join(timeout=5)
        self.file.seek(0)
        stacks = self.file.read()
        self.file.close()
        return stacks


def _machine() -> str:
    load = os.getloadavg()
    avail = "?"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, memory available {avail}"


_WATCHDOG: _Watchdog | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()
    _WATCHDOG.start()


FREEZE_AFTER_MODULES = 100  # imported since the last freeze: collect and freeze again
_frozen_at = 0  # len(sys.modules) at the last freeze


def _freeze() -> None:
    global _frozen_at
    gc.collect()
    gc.freeze()
    _frozen_at = len(sys.modules)


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.unfreeze()  # collectable again at exit (extensions that count their leaks see none)


@pytest.hookimpl(trylast=True)  # after the module's own fixtures were torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    module = getattr(item, "module", None)
    if (getattr(nextitem, "module", None) is not module
            and len(sys.modules) - _frozen_at >= FREEZE_AFTER_MODULES):
        _freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _WATCHDOG is not None:
        _WATCHDOG.test = item.nodeid
    try:
        return (yield)
    finally:
        if _WATCHDOG is not None:
            _WATCHDOG.test = "(between tests)"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _WATCHDOG is None:
        return
    stacks = _WATCHDOG.stop()
    if not _WATCHDOG.stalls:
        return
    tr = terminalreporter
    tr.section(f"stalls of the test process (no Python ran for {STALL_S:.0f} s or more, or a "
               f"garbage collection took {GC_SLOW_S:.0f} s or more)")
    for line in _WATCHDOG.stalls:
        tr.write_line(line)
    if stacks:
        tr.write_line("stacks faulthandler wrote during the stalls:")
        tr.write_line(stacks[-20000:])
