"""kvhandoff.testing.conformance run against every transport: tcp, inproc, ucx, shm (host
buffers, and buffers in kvhandoff shared segments: the map lane), nixl and auto where nixl_cu12
is installed. The kit's checks replace the per-transport copies of the same checks
(two-sided byte exactness, one-sided write with digest, cancel, disconnect)."""

from __future__ import annotations

import pytest
from test_conformance import CHUNK, UCX_SHM, WAIT_S, base_kind, need

from kvhandoff.buffers.shared import SharedSegment
from kvhandoff.settings import Settings
from kvhandoff.testing.conformance import CHECKS, ConformanceError, Options, run_check
from kvhandoff.transports import Transport, load_transport

KINDS = ["inproc", "tcp", "ucx", "shm", "shm-map", "nixl", "auto"]
BUF = 1 << 20


def factory(kind: str) -> tuple[object, Options]:
    s = Settings(chunk_bytes=CHUNK, stall_timeout_s=WAIT_S, auto_cross_host="tcp",
                 **UCX_SHM)  # type: ignore[arg-type]

    def make() -> Transport:
        return load_transport(base_kind(kind), s)

    if kind == "shm-map":
        return make, Options(buffer_bytes=BUF, wait_s=WAIT_S,
                             make_buffer=lambda n: SharedSegment(n).array)
    return make, Options(buffer_bytes=BUF, wait_s=WAIT_S)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", KINDS)
def test_transport_passes_the_kit(kind: str, check: str) -> None:
    make, opts = factory(need(kind))
    result = run_check(check, make, opts)  # type: ignore[arg-type]
    writes = base_kind(kind) in ("shm", "nixl", "auto")
    if check == "one_sided":
        assert result == ("passed" if writes else f"skipped: the {kind} transport has no "
                          "one-sided writes"), result
    else:
        assert result == "passed", result


def test_the_kit_catches_a_transport_that_corrupts() -> None:
    """The kit can fail: a transport that flips a received byte fails two_sided."""
    from kvhandoff.testing.faults import Corrupt, FaultyTransport

    s = Settings(chunk_bytes=CHUNK, stall_timeout_s=WAIT_S)

    def make() -> Transport:  # flips a byte of every receive into "kv" (the kit's tags: layer 0)
        return FaultyTransport(load_transport("tcp", s), corrupt=[Corrupt(0, "kv", times=9)],
                               receive_corruption=True)

    with pytest.raises(ConformanceError, match="two_sided"):
        run_check("two_sided", make, Options(buffer_bytes=BUF, wait_s=WAIT_S))


def test_ucx_runs_in_a_process_with_over_1024_descriptors_open() -> None:
    """An engine process holds many sockets and files: the UCX I/O thread's descriptors then
    lie past select()'s range (1,024), where it raised ValueError and the thread died (seen
    when a long test session had opened that many). It waits with poll()."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    fd = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(fd) for _ in range(1100)]
    try:
        assert max(held) >= 1024
        make, opts = factory(need("ucx"))
        assert run_check("two_sided", make, opts) == "passed"  # type: ignore[arg-type]
    finally:
        for d in held:
            os.close(d)
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
