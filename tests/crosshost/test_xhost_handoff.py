"""A handoff between two hosts: a prefill agent process on host A, a decode agent process on
host B, the bootstrap server on host A, two network namespaces joined by a veth pair
(conftest, xhost.py). Every landed byte is checked against the prefill's pattern, on each
lane that reaches another host: auto (its cross-host part, UCX), tcp, ucx, nixl."""

from __future__ import annotations

import importlib.util

import pytest
from xhost import (
    HB_S,
    RETENTION_S,
    Agent,
    AgentPair,
    Hosts,
    Skip,
    assert_quiet,
    handoff,
    make_hosts,
    start_pair,
)

SEQ = 1000
PREFIX = 200  # page-aligned down to 192: the decode holds the indexer rows of 12 pages
QUIET_S = 2 * HB_S + RETENTION_S + 5.0  # a closed peer is dropped, finished rooms forgotten

TRANSPORTS = [
    "auto", "tcp",
    pytest.param("ucx", marks=pytest.mark.long),
    pytest.param("nixl", marks=[pytest.mark.long, pytest.mark.skipif(
        importlib.util.find_spec("nixl_cu12") is None,
        reason="nixl_cu12 is not installed (the nixl extra)")]),
]
# what each side's transport status must show: the lane over the veth (device kvhxa/kvhxb)
LANE = {"auto": "ucx:tcp/kvhx", "tcp": "tcp", "ucx": "tcp/kvhx", "nixl": "nixl/ucx:tcp"}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_handoff_across_hosts_is_byte_exact(hosts: Hosts, pair: AgentPair, transport: str
                                           ) -> None:
    p, d = pair(transport)
    pd, dd = handoff(p, d, SEQ, prefix=PREFIX)
    cached = PREFIX // 16 * 16
    # both regions move suffix-only: the decode holds the cached prefix of each
    want = {"main_kv": (SEQ - cached) * 656 * 8, "indexer_k": (SEQ - cached) * 132 * 3}
    assert dd["stats"]["bytes_per_region"] == want == pd["stats"]["bytes_per_region"]
    # each side's peer is the other host's agent
    assert pd["stats"]["peers"] == [d.address] and d.address.startswith(hosts.ip[1])
    assert dd["stats"]["peers"] == [p.address] and p.address.startswith(hosts.ip[0])
    assert dd["stats"]["one_sided"] is (transport == "nixl") is pd["stats"]["one_sided"]
    for a in (p, d):
        st = a.status()
        tr = st["transport"]
        assert tr["kind"] == transport
        assert any(lane.startswith(LANE[transport]) for lane in tr["lanes"]), tr
        if transport == "auto":  # the other host's peer went cross-host, nobody over shm
            assert "shm for 0 same-host peer(s), ucx for 1 peer(s)" in tr["reason"], tr
        # no control message took the same-host Unix socket (it does not cross namespaces)
        assert st["counters"]["messages_out_local"] == 0, st["counters"]
        assert st["counters"]["messages_out"] >= 3
    # nothing left behind: the decode closes, the prefill drops it and forgets the room
    assert d.close() == 0
    assert_quiet(p, peers=True, timeout=QUIET_S)


@pytest.mark.long
def test_namespaces_sharing_the_machine_name() -> None:
    """Two network namespaces whose processes keep this machine's name have one host id
    (boot id + host name) and one PID namespace: kvhandoff's host identity calls them one
    host. `auto` still does not take its shm lane between them: the shm part's Unix socket
    (an abstract name, seen only in its own network namespace) cannot prove the peer's
    process, so the peer goes cross-host (UCX), named in the status with that reason. The
    handoff is byte-exact, two-sided."""
    started: list[Agent] = []
    try:
        with make_hosts(own_names=False) as h:
            try:
                p, d = start_pair(h, "auto", started)
                pd, dd = handoff(p, d, SEQ, prefix=PREFIX)
                tr = p.status()["transport"]
                assert "shm for 0 same-host peer(s), ucx for 1 peer(s)" in tr["reason"], tr
                assert "same-host peer(s) over ucx" in tr["reason"], tr
                assert "did not prove it is the peer" in tr["reason"], tr
                assert not pd["stats"]["one_sided"] and not dd["stats"]["one_sided"]
            finally:
                for a in started:
                    a.close()
    except Skip as e:
        pytest.skip(str(e))
