"""The parent's side of a simulated engine: `spawn(role, config)` starts ``python -m
kvhandoff.engine_sim`` (or a wrapper of it taking the same arguments) and a thread reading its
events; `EngineProcess.expect(kind, timeout)` waits for one, bounded.

Rules: every wait is bounded and says what it waited for, with the child's stderr; leaving the
`with` block kills the child.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineProcess:
    """A running `python -m kvhandoff.engine_sim` process and its events."""

    role: str
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)

    def expect(self, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
        """The next event of `kind` (matching `match`), waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for ev in self.seen:
            if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                self.seen.remove(ev)
                return ev
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role}: no {kind!r} event within {timeout}s; stderr: "
                                   + "".join(self.stderr_tail[-20:]))
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if ev["event"] == "eof":
                # its rooms' ends say why it left early (a room Failed, and its reason)
                done = [{k: e.get(k) for k in ("room", "state", "failure")}
                        for e in self.seen if e["event"] == "done"]
                raise RuntimeError(f"{self.role} exited (rc={self.proc.poll()}) before {kind!r}; "
                                   f"rooms done: {done}; stderr: "
                                   + "".join(self.stderr_tail[-20:]))
            if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                return ev
            self.seen.append(ev)

    def stalls(self) -> list[str]:
        """The lines its agents logged for a control loop that came round over a heartbeat
        late (`ControlLoop._stalled`): for the message of a room that failed for silence."""
        return [ln.strip() for ln in self.stderr_tail if "control loop stalled" in ln]

    def all_events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["event"] == kind]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self, timeout: float = 10) -> int:
        """Ends the process (closing stdin first, then SIGTERM, then SIGKILL)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(3)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()


def spawn(role: str, cfg: dict[str, Any], *, env: dict[str, str] | None = None,
          module: str = "kvhandoff.engine_sim") -> EngineProcess:
    """Starts `python -m <module> role cfg` (this module, or a wrapper of it that takes the
    same arguments) and a thread reading its events."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, role, json.dumps(cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True)
    sp = EngineProcess(role=role, proc=proc)

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                sp.events.put(json.loads(line))
            except json.JSONDecodeError:
                sp.stderr_tail.append("stdout: " + line)
        sp.events.put({"event": "eof"})

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sp.stderr_tail.append(line)
            del sp.stderr_tail[:-200]

    threading.Thread(target=read_out, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    return sp
