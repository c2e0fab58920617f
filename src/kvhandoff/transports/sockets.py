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
                hwm: int | None) -> tuple[zmq.Socket[bytes], str]:
    """A ROUTER bound on `host`, port 0, and its endpoint. `hwm`: both high-water marks
    (0: unbounded; None: ZMQ's default). Raises TransportError (`what`: the transport's name)
    when the address cannot be bound; the socket is then closed."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        router.setsockopt(zmq.RCVHWM, hwm)
        router.setsockopt(zmq.SNDHWM, hwm)
    router.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
    router.setsockopt(zmq.IPV6, zmq_ipv6(host))
    try:
        router.bind(zmq_endpoint(host, 0))
    except zmq.ZMQError as e:
        router.close()
        raise TransportError(f"{what}: cannot bind agent_host={host!r}: {e}") from e
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_dealer(ctx: zmq.Context[zmq.Socket[bytes]], ident: bytes, endpoint: str, *,
                   hwm: int | None) -> zmq.Socket[bytes]:
    """A DEALER with routing id `ident` connected to a peer's ROUTER at `endpoint`; `hwm` as
    for bind_router."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, zmq_ipv6(split_zmq_endpoint(endpoint)[0]))
    sock.connect(endpoint)
    return sock
