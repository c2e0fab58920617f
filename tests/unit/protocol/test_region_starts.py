"""The decode's per-region starts on the wire (`TransferRequest.region_starts`): what the
prefill accepts (`admission.region_starts`) and what an ``early`` decode says it reserved for
a region that starts later than its prefix (`admission.reserved_pages`). The agents' handoff
with a region start is tests/unit/runtime/test_region_starts.py."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.admission import region_starts, reserved_pages


def layout() -> LayoutSpec:
    def region(name: str, layers: tuple[int, ...]) -> RegionSpec:
        return RegionSpec(name=name, layer_ids=layers, planes=(Plane("kv", 64),),
                          send_from=SendFrom.DECODE_PREFIX)
    return LayoutSpec(page_size_tokens=16, kv_dtype="bf16", model="m",
                      regions=(region("full", (2,)), region("swa", (0, 1))))


def request(starts: dict[str, int] | None, *, seq: int = 150) -> P.TransferRequest:
    return P.TransferRequest(src="d:1", gen=1, room=1, xfer=1, peer_gen=1, seq_len=seq,
                             decode_prefix_len=0, page_size=16, dst_pages={}, lease_s=5.0,
                             region_starts=starts)


def test_starts_accepted_and_survive_the_wire() -> None:
    msg = P.decode(P.encode(request({"swa": 64})), max_bytes=1 << 20)
    assert isinstance(msg, P.TransferRequest)
    assert region_starts(msg, layout()) == {"swa": 64}
    assert region_starts(request(None), layout()) == {}


@pytest.mark.parametrize(("starts", "why"), [
    ({"nope": 64}, r"region_starts\['nope'\]: not a region of this layout"),
    ({"swa": 70}, r"region_starts\['swa'\]: 70 is not a token in 0..150 aligned to the "
                  r"decode page size 16"),
    ({"swa": 160}, r"region_starts\['swa'\]: 160 is not a token in 0..150"),
    ({"swa": -16}, r"region_starts\['swa'\]: -16 is not a token"),
])
def test_bad_starts_refused_naming_the_field(starts: dict[str, int], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        region_starts(request(starts), layout())


def test_early_reservation_counts_the_pages_a_window_skips_as_held() -> None:
    # 150 tokens: 10 pages; the window region's table starts at token 64 (page 4): 6 pages
    pages = {"full": list(range(10)), "swa": list(range(20, 26))}
    assert reserved_pages(layout(), pages, 0, 16, {"swa": 64}) == {"full": 10, "swa": 10}
    # with a cached prefix of 2 pages, both tables start later; the window's skip is relative
    pages = {"full": list(range(8)), "swa": list(range(20, 26))}
    assert reserved_pages(layout(), pages, 32, 16, {"swa": 64}) == {"full": 8, "swa": 8}
    # no starts: as before (a short window table is short)
    assert reserved_pages(layout(), pages, 32, 16) == {"full": 8, "swa": 6}
