#!/usr/bin/env python3
"""kvhandoff-placeholder-engine: stands in for a prefill or decode engine in the compose demo.

It does what an engine's kvhandoff integration does toward the bootstrap sidecar, and nothing
else: register one rank (role, engine id, layout preset, agent address, transport), heartbeat
it, re-register when the sidecar forgot it (404 after a sidecar restart), deregister on
SIGTERM/SIGINT. It moves no KV bytes and runs no model. Replace it with your engine process,
configured with the same ``KVHANDOFF_*`` variables.

    kvhandoff-placeholder-engine --role prefill            # settings from KVHANDOFF_* env
    kvhandoff-placeholder-engine --check-alive 15          # healthcheck: exit 0 when the last
                                                           # heartbeat is under 15 s old

Settings read: ``KVHANDOFF_BOOTSTRAP_URL`` (required), ``KVHANDOFF_AUTH_TOKEN``,
``KVHANDOFF_TRANSPORT``, ``KVHANDOFF_AGENT_HOST``, ``KVHANDOFF_AGENT_PORT``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

DEFAULT_ALIVE_FILE = "/tmp/kvhandoff-engine.alive"
# an agent_port of 0 (the default: any free port) cannot be advertised; a placeholder has no
# agent listening anyway, so it advertises this port unless KVHANDOFF_AGENT_PORT is set
PLACEHOLDER_AGENT_PORT = 5557


def _touch(path: Path | None) -> None:
    if path is not None:
        # write then rename: a healthcheck reading concurrently never sees a half-written file
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{time.time():.3f}\n")
        os.replace(tmp, path)


def alive_age_s(path: Path, *, now: float | None = None) -> float | None:
    """Seconds since the last successful register/heartbeat; None when there was none."""
    try:
        stamp = float(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return (time.time() if now is None else now) - stamp


def run(
    client: Any,
    *,
    role: str,
    engine_id: str,
    layout: Any,
    agent_address: str,
    transport: str,
    heartbeat_s: float,
    stop: threading.Event,
    alive_file: Path | None = None,
    on_registered: Any = None,
) -> int:
    """Register, heartbeat until `stop` is set, deregister. Returns the number of heartbeats.

    `client` is a `kvhandoff.bootstrap_server.client.BootstrapClient`.
    """
    from kvhandoff.errors import BootstrapNotFound

    generation = uuid.uuid4().hex

    def register() -> None:
        client.register_rank(engine_id=engine_id, role=role, agent_address=agent_address,
                             generation=generation, layout=layout, transport=transport)
        _touch(alive_file)

    register()
    if on_registered is not None:
        on_registered()
    beats = 0
    # the event's wait is the loop's clock: a stop request ends the wait at once
    while not stop.wait(heartbeat_s):
        try:
            client.heartbeat(engine_id=engine_id, generation=generation)
        except BootstrapNotFound:
            register()  # the sidecar restarted or dropped us after a missed TTL
        else:
            _touch(alive_file)
        beats += 1
    client.deregister(engine_id=engine_id, generation=generation)
    return beats


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvhandoff-placeholder-engine",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--engine-id", default=None, help="default: <role>-<hostname>")
    ap.add_argument("--layout", default="glm-5.3", help="layout preset (default %(default)s)")
    ap.add_argument("--heartbeat-s", type=float, default=5.0,
                    help="seconds between heartbeats; keep well under the server's rank_ttl_s")
    ap.add_argument("--alive-file", default=DEFAULT_ALIVE_FILE,
                    help="touched after each successful register/heartbeat (default %(default)s)")
    ap.add_argument("--check-alive", type=float, default=None, metavar="MAX_AGE_S",
                    help="healthcheck mode: exit 0 when the alive file is under MAX_AGE_S old")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    alive_file = Path(args.alive_file)
    if args.check_alive is not None:
        age = alive_age_s(alive_file)
        if age is None or age > args.check_alive:
            print(f"{alive_file}: last heartbeat {age if age is None else round(age, 1)} s ago, "
                  f"limit {args.check_alive} s", file=sys.stderr)
            return 1
        return 0

    from kvhandoff.bootstrap_server.client import BootstrapClient
    from kvhandoff.kv_layout import preset
    from kvhandoff.settings import Settings

    settings = Settings()
    host = settings.agent_host
    if host in ("127.0.0.1", "0.0.0.0", "localhost"):
        host = socket.gethostname()  # what the other containers can resolve
    agent_address = f"{host}:{settings.agent_port or PLACEHOLDER_AGENT_PORT}"
    engine_id = args.engine_id or f"{args.role}-{socket.gethostname()}"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with BootstrapClient.from_settings(settings) as client:
        beats = run(client, role=args.role, engine_id=engine_id, layout=preset(args.layout),
                    agent_address=agent_address, transport=settings.transport,
                    heartbeat_s=args.heartbeat_s, stop=stop, alive_file=alive_file,
                    on_registered=lambda: print(
                        f"registered {args.role} rank {engine_id} ({agent_address}, "
                        f"{settings.transport}) at {settings.bootstrap_url}", flush=True))
    print(f"deregistered {engine_id} after {beats} heartbeats", flush=True)
    try:
        os.unlink(alive_file)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
