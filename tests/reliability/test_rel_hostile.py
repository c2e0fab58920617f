"""Hostile input on the network-facing surfaces (`kvhandoff.testing.hostile`): nothing an
outsider sends ends an agent's control thread; it counts what it refused and still hands off.
"""

from __future__ import annotations

import secrets

import pytest
from relkit import WAIT_S, Engine, Prober, engine_pair, fast_settings, handoff, wait_until

from kvhandoff.runtime.locallane import available
from kvhandoff.testing import hostile

OWN_LANES = True  # the control surfaces do not depend on the data transport


def counters(e: Engine) -> dict[str, int]:
    return e.agent.status()["counters"]


def alive(e: Engine) -> bool:
    t = e.agent._loop._thread
    return t is not None and t.is_alive()


@pytest.mark.parametrize("surface", ["control", "lane"])
def test_deeply_nested_frame_leaves_the_agent_serving(surface: str) -> None:
    """A Hello whose layout nests 10,000 maps (about 30 KB, no secret needed) used to raise
    RecursionError in decode and end the control thread; it is refused and counted."""
    if surface == "lane" and not available():
        pytest.skip("no same-host lane on this platform")
    with engine_pair(settings=fast_settings(), num_pages=8) as (p, d):
        before = counters(p)["rejected_messages"]
        frame = hostile.nested_maps(10_000)
        if surface == "control":
            hostile.send_control(p.address, [frame] * 3)
        else:
            hostile.send_lane(p.address, [frame] * 3)
        assert wait_until(lambda: counters(p)["rejected_messages"] - before >= 3, WAIT_S)
        with Prober(p.address) as pr:
            pr.barrier("prefill")
        assert alive(p)
        assert counters(p)["rejected_messages"] - before == 3
        r = secrets.randbits(63)
        handoff(p, d, r, 40)
        assert d.bad_bytes(r, 40) == 0
