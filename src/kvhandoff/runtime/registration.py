"""The agent's side of the bootstrap server: register + heartbeat (prefill), route lookup
(decode). Each runs on a thread of its own so HTTP never blocks the control loop or the engine.

A prefill agent re-registers by itself when the server forgets it (a heartbeat answered 404,
e.g. after the server restarted), so readiness comes back without operator action.

A decode agent's route lookups all run on ONE thread, `RouteLookups`: an asyncio loop with one
HTTP client per bootstrap server, every open lookup a task on it. A thousand rooms opening at
once are a thousand tasks, not a thousand threads, and a lookup that waits (the room's prefill
has not registered yet; the client retries until its total wait) holds back no other one.
At most `LOOKUPS_IN_FLIGHT` requests are on the wire at once (per request: a lookup between
two tries holds no place).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvhandoff.errors import BootstrapError, BootstrapNotFound, KVHandoffError
from kvhandoff.kv_layout import TPSplit, layout_hash

if TYPE_CHECKING:
    from kvhandoff.bootstrap_server.client import AsyncBootstrapClient, BootstrapClient
    from kvhandoff.bootstrap_server.schemas import PrefillRankInfo
    from kvhandoff.kv_layout import LayoutSpec
    from kvhandoff.settings import Settings
    from kvhandoff.transports.base import Transport


class AgentIdentity(Protocol):
    """What registration and lookups read of their agent (`TransferAgent` is one)."""

    settings: Settings
    agent_id: str
    engine_id: str
    address: str
    generation: int
    layout: LayoutSpec
    transport: Transport
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int


log = logging.getLogger("kvhandoff.agent")


def _client(agent: AgentIdentity, url: str, total_wait_s: float | None = None,
            stop: threading.Event | None = None) -> BootstrapClient:
    from kvhandoff.bootstrap_server.client import BootstrapClient

    if "://" not in url:
        url = f"http://{url}"
    token = agent.settings.auth_token
    wait = agent.settings.bootstrap_timeout_s if total_wait_s is None else total_wait_s
    return BootstrapClient(url, token=token.get_secret_value() if token else None,
                           total_wait_s=wait, stop=stop)


class Registration:
    """Keeps a prefill agent registered with `settings.bootstrap_url`."""

    def __init__(self, agent: AgentIdentity) -> None:
        self._agent = agent
        assert agent.settings.bootstrap_url
        # one try per heartbeat period: a server that is down must not hold the loop (or
        # close()) for the whole bootstrap timeout; the next period tries again
        period = max(0.05, agent.settings.rank_ttl_s / 3)
        self._stop = threading.Event()  # also ends a call in its retries (close joins)
        self._client = _client(agent, agent.settings.bootstrap_url,
                               total_wait_s=min(agent.settings.bootstrap_timeout_s,
                                                max(1.0, period)), stop=self._stop)
        self.registered = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvh-register-{agent.agent_id}")
        self._thread.start()

    def _ident(self) -> dict[str, Any]:
        a = self._agent
        return {"engine_id": a.engine_id, "dp_rank": a.dp_rank, "tp_rank": a.tp_rank}

    def _register(self) -> None:
        a = self._agent
        a_status = a.transport.status()
        if "host-staging" in a_status.lanes:  # device pages through host memory: /ready says
            label = f"{a_status.kind}-staged"
        elif a_status.degraded and a_status.kind != "tcp":
            label = f"{a_status.kind}-tcp"
        else:
            label = a_status.kind
        self._client.register_rank(
            role="prefill", agent_address=a.address, generation=str(a.generation),
            layout=a.layout.tp_invariant(), layout_hash=layout_hash(a.layout.tp_invariant()),
            dp_size=a.dp_size, tp_size=a.tp_size,
            transport=label, **self._ident())
        self.registered.set()
        self.error = None

    def _run(self) -> None:
        interval = max(0.05, self._agent.settings.rank_ttl_s / 3)
        need_register = True
        while not self._stop.is_set():
            try:
                if need_register:
                    self._register()
                    need_register = False
                else:
                    self._client.heartbeat(generation=str(self._agent.generation),
                                           **self._ident())
            except BootstrapNotFound:
                log.warning("bootstrap server forgot this rank; registering again")
                need_register = True
                continue
            except KVHandoffError as e:
                if self._stop.is_set():
                    break  # closing: a call cut short is no registration error
                self.error = str(e)
                self.registered.clear()
                need_register = True
                log.warning("bootstrap registration: %s", e)
            self._stop.wait(interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        assert self._agent.settings.bootstrap_url
        try:
            with _client(self._agent, self._agent.settings.bootstrap_url,
                         total_wait_s=2.0) as quick:
                quick.deregister(generation=str(self._agent.generation), **self._ident())
        except KVHandoffError:
            pass  # the server forgets the rank by its TTL anyway
        self._client.close()


Resolved = Callable[[tuple[tuple[str, int], ...], "str | None"], None]

#: lookup requests on the wire at once (the rest wait their turn on the lookup thread): the
#: HTTP pool assigns its queued requests to connections in time that grows with their number, so a
#: thousand rooms opened at once each waiting at the server (retrying) kept the lookup thread
#: busy in the pool, and closing the agent waited out its 5 s bound
LOOKUPS_IN_FLIGHT = 64


class RouteLookups:
    """A decode agent's route lookups on one thread (see the module doc), started on first
    use. `submit` never blocks; `done(sources, error)` is called on the lookup thread."""

    def __init__(self, agent: AgentIdentity) -> None:
        self._agent = agent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._clients: dict[str, AsyncBootstrapClient] = {}  # lookup thread only
        self._transport: Any = None  # lookup thread only: one HTTP transport for all clients
        self._start_lock = threading.Lock()
        self._closed = False
        self._inflight: asyncio.Semaphore | None = None  # lookup thread only

    def submit(self, room: int, bootstrap_addr: str, done: Resolved) -> None:
        """Looks the prefill ranks of `room` up at `bootstrap_addr` (any thread)."""
        loop = self._started()
        if loop is None:
            done((), "agent is closed")
            return
        try:
            asyncio.run_coroutine_threadsafe(self._lookup(room, bootstrap_addr, done), loop)
        except RuntimeError:  # the loop stopped meanwhile: the agent is closing
            done((), "agent is closed")

    def warm(self) -> None:
        """Starts the lookup thread and makes there what a first lookup would (the client's
        imports, the HTTP transport and its TLS context: 1 s of a first room on a loaded
        host), now; never blocks."""
        loop = self._started()
        if loop is not None:
            loop.call_soon_threadsafe(self._http_transport)

    def _started(self) -> asyncio.AbstractEventLoop | None:
        with self._start_lock:
            if self._closed:
                return None
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, daemon=True,
                                                name=f"kvh-lookup-{self._agent.agent_id}")
                self._thread.start()
                self._loop = loop
            return self._loop

    async def _lookup(self, room: int, bootstrap_addr: str, done: Resolved) -> None:
        try:
            ranks = await self._client(bootstrap_addr).lookup_route(
                room=room, tp_rank=self._agent.tp_rank, tp_size=self._agent.tp_size,
                replicated=_replicated(self._agent))
            sources = _sources(ranks, room, bootstrap_addr)
        except KVHandoffError as e:
            done((), str(e))
            return
        except Exception as e:  # noqa: BLE001 - the room fails with it instead of waiting
            done((), f"{type(e).__name__}: {e}")
            return
        done(tuple(sources), None)

    def _client(self, bootstrap_addr: str) -> AsyncBootstrapClient:
        from kvhandoff.bootstrap_server.client import AsyncBootstrapClient

        c = self._clients.get(bootstrap_addr)
        if c is None:
            url = bootstrap_addr if "://" in bootstrap_addr else f"http://{bootstrap_addr}"
            token = self._agent.settings.auth_token
            c = self._clients[bootstrap_addr] = AsyncBootstrapClient(
                url, token=token.get_secret_value() if token else None,
                total_wait_s=self._agent.settings.bootstrap_timeout_s,
                transport=self._http_transport(), gate=self._gate())
        return c

    def _gate(self) -> asyncio.Semaphore:
        """(lookup thread) Bounds the requests on the wire at once, every client together;
        held per request, not across a lookup's retries: a lookup waiting at the server for
        its room holds back no other one between its tries."""
        if self._inflight is None:  # made on the loop it is used on
            self._inflight = asyncio.Semaphore(LOOKUPS_IN_FLIGHT)
        return self._inflight

    def _http_transport(self) -> Any:
        """(lookup thread) The HTTP transport every client here shares (its pool keys
        connections by server), with the process's one TLS context (`tls_context`)."""
        if self._transport is None:
            import anyio  # noqa: F401 - httpcore's async backend, imported on a first request
            import httpx

            from kvhandoff.bootstrap_server.client import tls_context

            self._transport = httpx.AsyncHTTPTransport(verify=tls_context())
        return self._transport

    def close(self) -> None:
        """Cancels the open lookups (their rooms are failed by the agent's close), closes the
        clients, ends the thread. Idempotent."""
        with self._start_lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            me = asyncio.current_task()
            open_lookups = [t for t in asyncio.all_tasks() if t is not me]
            for t in open_lookups:
                t.cancel()
            # each ends (its connection back in the pool) before the clients close: a pool
            # closed under a thousand requests still in it took longer than close's bound
            await asyncio.gather(*open_lookups, return_exceptions=True)
            for c in self._clients.values():
                await c.close()
            self._clients.clear()
            if self._transport is not None:  # closed by its first client's close; again: no-op
                await self._transport.aclose()

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=5)
        except Exception as e:  # noqa: BLE001 - closing: say so, go on
            log.warning("route lookups: closing: %r", e)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not loop.is_running():
            loop.close()


def _replicated(agent: AgentIdentity) -> bool:
    return all(r.tp_split is TPSplit.REPLICATED for r in agent.layout.regions)


def _sources(ranks: list[PrefillRankInfo], room: int, bootstrap_addr: str
             ) -> list[tuple[str, int]]:
    if not ranks:
        raise BootstrapError(f"bootstrap server {bootstrap_addr}: no prefill rank for room {room}")
    out = []
    for info in ranks:
        try:
            gen = int(info.generation)
        except ValueError:
            gen = 0
        out.append((info.agent_address, gen))
    return out
