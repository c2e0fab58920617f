"""The agent's side of the bootstrap server: register + heartbeat (prefill), route lookup
(decode). Runs on its own thread so HTTP never blocks the control loop or the engine.

A prefill agent re-registers by itself when the server forgets it (a heartbeat answered 404,
e.g. after the server restarted), so readiness comes back without operator action.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvhandoff.errors import BootstrapError, BootstrapNotFound, KVHandoffError
from kvhandoff.kv_layout import TPSplit, layout_hash

if TYPE_CHECKING:
    from kvhandoff.bootstrap_server.client import BootstrapClient
    from kvhandoff.transfer.agent import TransferAgent

log = logging.getLogger("kvhandoff.agent")


def _client(agent: TransferAgent, url: str, total_wait_s: float | None = None
            ) -> BootstrapClient:
    from kvhandoff.bootstrap_server.client import BootstrapClient

    if "://" not in url:
        url = f"http://{url}"
    token = agent.settings.auth_token
    wait = agent.settings.bootstrap_timeout_s if total_wait_s is None else total_wait_s
    return BootstrapClient(url, token=token.get_secret_value() if token else None,
                           total_wait_s=wait)


class Registration:
    """Keeps a prefill agent registered with `settings.bootstrap_url`."""

    def __init__(self, agent: TransferAgent) -> None:
        self._agent = agent
        assert agent.settings.bootstrap_url
        # one try per heartbeat period: a server that is down must not hold the loop (or
        # close()) for the whole bootstrap timeout; the next period tries again
        period = max(0.05, agent.settings.rank_ttl_s / 3)
        self._client = _client(agent, agent.settings.bootstrap_url,
                               total_wait_s=min(agent.settings.bootstrap_timeout_s,
                                                max(1.0, period)))
        self._stop = threading.Event()
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
        self._client.register_rank(
            role="prefill", agent_address=a.address, generation=str(a.generation),
            layout=a.layout.tp_invariant(), layout_hash=layout_hash(a.layout.tp_invariant()),
            dp_size=a.dp_size, tp_size=a.tp_size,
            transport=(f"{a_status.kind}-tcp" if a_status.degraded and a_status.kind != "tcp"
                       else a_status.kind), **self._ident())
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


def lookup_prefill(agent: TransferAgent, room: int, bootstrap_addr: str) -> list[tuple[str, int]]:
    """The control addresses and generations of the prefill ranks this decode rank reads
    `room` from: one rank when every region is replicated (MLA), the ranks holding its heads
    when a region is head-sharded (GQA; several when decode TP < prefill TP)."""
    replicated = all(r.tp_split is TPSplit.REPLICATED for r in agent.layout.regions)
    with _client(agent, bootstrap_addr) as c:
        ranks = c.lookup_route(room=room, tp_rank=agent.tp_rank, tp_size=agent.tp_size,
                               replicated=replicated)
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
