# The ZMQ sockets of the transports that talk over ZMQ (tcp's data and credits, shm's control
# messages): each binds one ROUTER on agent_host and connects one DEALER per peer.
#
# Rules: a socket is made here with every option its caller names (nothing implied: the
# high-water marks and ROUTER_HANDOVER are the caller's choice, stated at its call) and is
# then owned by that transport's I/O thread. A bind that fails closes what it made and
# raises TransportError naming agent_host.
from __future__ import annotations

import zmq

from kvhandoff.errors import TransportError
from kvhandoff.netaddr import split_zmq_endpoint, zmq_endpoint, zmq_ipv6


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], host: str, *, what: str, handover: bool,
                hwm: int | None, max_message: int | None = None) -> tuple[zmq.Socket[bytes], str]:
    """A ROUTER bound on `host`, port 0, and its endpoint. `hwm`: both high-water marks
    (0: unbounded; None: ZMQ's default); `max_message`: the largest message a connection may
    send (bytes; larger closes it; None: no bound). Raises TransportError (`what`: the
    transport's name) when the address cannot be bound; the socket is then closed."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        router.setsockopt(zmq.RCVHWM, hwm)
        router.setsockopt(zmq.SNDHWM, hwm)
    if max_message is not None:
        router.setsockopt(zmq.MAXMSGSIZE, max_message)
    router.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
    router.setsockopt(zmq.IPV6, zmq_ipv6(host))
    try:
        router.bind(zmq_endpoint(host, 0))
    except zmq.ZMQError as e:
        router.close()
        raise TransportError(f"{what}: cannot bind agent_host={host!r}: {e}") from e
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_dealer(ctx: zmq.Context[zmq.Socket[bytes]], ident: bytes | None, endpoint: str, *,
                   hwm: int | None, rcvhwm: int | None = None,
                   monitor: int = 0) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
    """A DEALER connected to a peer's ROUTER at `endpoint`, with routing id `ident` (None: the
    ROUTER names the connection itself), and its monitor socket for the `monitor` events
    (made before the connect, so the first connection is seen; 0: none). `hwm` as for
    bind_router; `rcvhwm` (when given) sets the receive side apart from it."""
    sock = ctx.socket(zmq.DEALER)
    if ident is not None:
        sock.setsockopt(zmq.IDENTITY, ident)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, zmq_ipv6(split_zmq_endpoint(endpoint)[0]))
    mon = sock.get_monitor_socket(monitor) if monitor else None
    sock.connect(endpoint)
    return sock, mon
