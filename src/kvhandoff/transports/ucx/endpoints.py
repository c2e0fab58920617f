# The UCX transport's endpoint cache (I/O thread only).
#
# Endpoints outlive disconnect(). UCX pairs our endpoint with the peer's at wireup, and the
# peer's rendezvous messages name our endpoint; closing it alone, without the peer knowing,
# leaves the peer's endpoint naming a closed one, and every large message it sends us after
# fails here with "Request canceled" (UCX drops an RTS for an unknown endpoint), even after we
# connect again. So a disconnected peer's endpoint is parked, keyed by address, for a later
# connect to the same address (an agent that took a busy peer for dead reconnects without the
# peer noticing). A restarted peer has a new address; the endpoints of peers that never come
# back are closed beyond `idle_max`, a failed one (peer error handling) on reuse, and all of
# them at close. Except: while UCX may still touch the peer's memory for us, parking closes the
# endpoint, since closing is what stops that (the caller says so with `touching`).
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ucxx._lib import libucxx as ucx_api


def close_ep(ep: Any) -> None:
    """Closes an endpoint, unless UCX's error handling already failed it: closing an endpoint
    whose peer died (error callback called) crashes the process with SIGSEGV inside ucxx
    (reproduced: same-host pair with error handling, sender SIGKILLed while a receive was in
    flight, then disconnect()); a failed endpoint is only dropped."""
    if not ep.alive:
        return
    try:
        ep.close()
    except ucx_api.UCXError:
        pass


class EndpointCache:
    """Endpoints of connected peers, and parked ones of disconnected peers (module comment)."""

    __slots__ = ("_eps", "_address", "_idle", "_idle_max")

    def __init__(self, idle_max: int) -> None:
        self._eps: dict[str, Any] = {}
        self._address: dict[str, bytes] = {}  # peer -> the address its endpoint reaches
        # address -> endpoint of a disconnected peer, oldest first
        self._idle: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._idle_max = idle_max

    def get(self, peer: str) -> Any:
        """The peer's endpoint, None if not connected."""
        return self._eps.get(peer)

    def attach(self, peer: str, address: bytes, create: Callable[[], Any],
               touching: Callable[[str], bool]) -> Any:
        """The endpoint for `peer` at `address`: the current one, the parked one the peer's own
        endpoint is paired with, or a new one from `create`."""
        if peer in self._eps and self._address[peer] != address:
            self.park(peer, touching(peer))
        ep = self._eps.get(peer)
        if ep is None:
            ep = self._idle.pop(address, None)
            if ep is not None and not ep.alive:  # failed (peer error handling): replace
                close_ep(ep)
                ep = None
            if ep is None:
                ep = create()
            self._eps[peer] = ep
            self._address[peer] = address
        return ep

    def park(self, peer: str, touching: bool) -> None:
        """Keeps the peer's endpoint for a later connect to its address, unless it failed,
        UCX may still touch the peer's memory through it (`touching`: closing stops that), or
        another endpoint to that address is kept or in use; closes the oldest parked ones
        beyond idle_max."""
        ep = self._eps.pop(peer, None)
        address = self._address.pop(peer, None)
        if ep is None or address is None:
            return
        if (not ep.alive or touching or address in self._idle
                or address in self._address.values()):
            close_ep(ep)
            return
        self._idle[address] = ep
        while len(self._idle) > self._idle_max:
            close_ep(self._idle.popitem(last=False)[1])

    def close_all(self) -> None:
        for ep in [*self._eps.values(), *self._idle.values()]:
            close_ep(ep)
        self._eps.clear()
        self._address.clear()
        self._idle.clear()
