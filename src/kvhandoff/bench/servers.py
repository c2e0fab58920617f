"""Bootstrap servers as processes of their own, each yielding its URL: `serve_process()` runs
`kvhandoff serve --port 0`, `sglang_process()` runs SGLang's own bootstrap server
(``CommonKVBootstrapServer``, aiohttp). `kvhandoff bench --cases bootstrap` and the
differential test put the two side by side. Both print their URL once listening and stop when
their stdin closes (or on SIGTERM).

SGLang's ``conn.py`` imports its whole GPU runtime (torch, transformers, triton, torchvision,
...), which cannot all be installed on a CPU-only machine and takes ~10 s to import where it
can. So the host compiles the server's classes (``CommonKVBootstrapServer``,
``PrefillServerInfo``, ``PrefillRankInfo`` and the ``BaseKVBootstrapServer`` base) from the
installed SGLang source files, unchanged, with the names they use (aiohttp's ``web``, SGLang's
own ``envs``); ``KVHANDOFF_SGLANG_IMPORT=1`` makes it import ``conn.py`` the normal way instead
(falling back to compiling when that fails). Either way SGLang's app, routes and handlers
answer; the host only serves that app on a socket it bound itself (SGLang's ``_run_server``
binds a fixed port, which a test cannot pick without a race) and runs SGLang's expiry task as
``_run_server`` does. `sglang_unavailable()` says why it cannot run, or None.

Rules: a server that does not print its URL within its bound is killed and raised as a
`BootstrapError` with its stderr; leaving the block stops the process (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url
from kvhandoff.errors import BootstrapError

__all__ = ["serve_process", "sglang_process", "sglang_unavailable"]


# -- servers as processes ----------------------------------------------------------------------

_URL_RE = re.compile(r"(http://\S+)")


@contextmanager
def _process(argv: list[str], *, what: str, startup_timeout_s: float) -> Iterator[str]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = _readline(proc, startup_timeout_s)
        m = _URL_RE.search(line)
        if not m:
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise BootstrapError(f"{what} did not start: {line.strip()!r} {err[-2000:]}")
        yield m.group(1)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.terminate()  # both servers stop cleanly on SIGTERM
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line of ``proc``, waiting at most ``timeout_s``."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
                         daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        proc.kill()
        raise BootstrapError(f"no URL from {proc.args!r} within {timeout_s} s")
    return box[0]


@contextmanager
def serve_process(*args: str, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """`kvhandoff serve --port 0 ARGS` in its own process; yields its URL."""
    argv = [sys.executable, "-m", "kvhandoff.cli", "serve", "--port", "0",
            "--log-level", "warning", *args]
    with _process(argv, what="kvhandoff serve", startup_timeout_s=startup_timeout_s) as url:
        yield url


@contextmanager
def sglang_process(startup_timeout_s: float = 120.0) -> Iterator[str]:
    """SGLang's ``CommonKVBootstrapServer`` in its own process; yields its URL.

    Raises:
        BootstrapError: SGLang is not installed or its server did not start.
    """
    why = sglang_unavailable()
    if why is not None:
        raise BootstrapError(why)
    argv = [sys.executable, "-m", "kvhandoff.bench.servers", "sglang"]
    with _process(argv, what="SGLang's bootstrap server",
                  startup_timeout_s=startup_timeout_s) as url:
        yield url


def _sglang_root() -> Path | None:
    spec = importlib.util.find_spec("sglang")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_SGLANG_FILES = {
    "srt/disaggregation/base/conn.py": ("BaseKVBootstrapServer",),
    "srt/disaggregation/common/conn.py": ("PrefillServerInfo", "PrefillRankInfo",
                                          "CommonKVBootstrapServer"),
}


def sglang_unavailable() -> str | None:
    """Why SGLang's bootstrap server cannot run here (None: it can)."""
    root = _sglang_root()
    if root is None:
        return "sglang is not installed (pip install --no-deps sglang==0.5.23)"
    if importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed (SGLang's bootstrap server is an aiohttp app)"
    for rel in (*_SGLANG_FILES, "srt/environ.py"):
        if not (root / rel).is_file():
            return f"sglang at {root} has no {rel}"
    return None


def _load_sglang_server_class() -> tuple[type, str]:
    """SGLang's ``CommonKVBootstrapServer`` and how it was loaded (see the module doc)."""
    reason = "set KVHANDOFF_SGLANG_IMPORT=1 to import conn.py instead"
    if os.environ.get("KVHANDOFF_SGLANG_IMPORT") == "1":
        try:
            from sglang.srt.disaggregation.common.conn import (
                CommonKVBootstrapServer,
            )
        except Exception as e:  # its runtime cannot be imported here: compile the classes
            reason = f"importing conn.py failed: {type(e).__name__}: {e}"
        else:
            return CommonKVBootstrapServer, "conn.py imported"
    root = _sglang_root()
    assert root is not None
    import abc
    import dataclasses
    import time
    import typing

    from aiohttp import web

    env_spec = importlib.util.spec_from_file_location("_sglang_environ", root / "srt/environ.py")
    assert env_spec is not None and env_spec.loader is not None
    environ = importlib.util.module_from_spec(env_spec)
    sys.modules[env_spec.name] = environ
    env_spec.loader.exec_module(environ)
    mod = types.ModuleType("_sglang_bootstrap_conn")  # dataclasses look their module up
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update({
        "ABC": abc.ABC, "abstractmethod": abc.abstractmethod, "asyncio": asyncio,
        "dataclasses": dataclasses, "envs": environ.envs, "logging": logging,
        "logger": logging.getLogger("sglang.srt.disaggregation.common.conn"),
        "threading": threading, "time": time, "web": web,
        **{n: getattr(typing, n) for n in ("Any", "Dict", "List", "Optional", "Set", "Tuple",
                                            "Union")},
    })
    for rel, names in _SGLANG_FILES.items():
        path = root / rel
        tree = ast.parse(path.read_text(), filename=str(path))
        found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names}
        missing = [n for n in names if n not in found]
        if missing:
            raise BootstrapError(f"{path}: no class {', '.join(missing)} (another SGLang version?)")
        module = ast.Module(body=[ast.ImportFrom("__future__", [ast.alias("annotations")], 0),
                                  *(found[n] for n in names)], type_ignores=[])
        exec(compile(ast.fix_missing_locations(module), str(path), "exec"), ns)  # noqa: S102
    return ns["CommonKVBootstrapServer"], f"classes compiled from {root} ({reason})"


def _sglang_main() -> None:
    """Serve SGLang's bootstrap app on 127.0.0.1 and a free port until stdin closes."""
    from aiohttp import web

    cls, how = _load_sglang_server_class()

    class Host(cls):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            """SGLang starts its serving thread here; the host serves the app below."""

    server = Host("127.0.0.1", 0)
    sock = bind_socket("127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # as SGLang's _run_server: the room expiry task, then the app without an access log
    task = loop.create_task(server._cleanup_expired_entries())
    runner = web.AppRunner(server.app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    print(f"SGLang bootstrap server listening on {socket_url(sock)} ({how})", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(loop.stop)),
                     daemon=True).start()
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    try:
        loop.run_forever()
    finally:
        task.cancel()
        loop.run_until_complete(runner.cleanup())
        loop.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["sglang"]:
        raise SystemExit("usage: python -m kvhandoff.bench.servers sglang")
    _sglang_main()
