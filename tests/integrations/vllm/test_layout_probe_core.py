"""`kvhandoff.integrations.layout_probe` on plain byte buffers: a layout that says where the bytes
are passes; one that puts a plane elsewhere is refused naming the slot and the plane, and says
where the bytes really landed."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.integrations.layout_probe import (
    LayoutProbeError,
    check_region,
    distinct_values,
    require_agreement,
    slot_address,
)
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec

PS = 4  # rows per page


def layout(planes: tuple[Plane, ...]) -> LayoutSpec:
    return LayoutSpec(page_size_tokens=PS, kv_dtype="u8", regions=(
        RegionSpec(name="kv", layer_ids=(0,), planes=planes),))


def written(planes_bytes: list[int], slots: list[int], *, plane_major: bool) -> tuple[
        np.ndarray, dict[tuple[int, str], np.ndarray]]:
    """A 2-page buffer written by a 'kernel' that keeps each plane's rows together
    (plane_major) or each row's planes together (row-major)."""
    total = sum(planes_bytes)
    buf = np.zeros(2 * PS * total, dtype=np.uint8)
    expected = {}
    for s in slots:
        page, row = divmod(s, PS)
        acc = 0
        for k, nb in enumerate(planes_bytes):
            v = distinct_values(nb, salt=s * 100 + k)
            expected[(s, f"p{k}")] = v
            off = (page * PS * total + (acc * PS + row * nb if plane_major
                                        else row * total + acc))
            buf[off:off + nb] = v
            acc += nb
    return buf, expected


def test_agreeing_layout_passes() -> None:
    lay = layout((Plane("p0", 8), Plane("p1", 8)))
    buf, exp = written([8, 8], [0, 3, 5], plane_major=True)
    assert check_region(lay, "kv", {"kv": {0: buf}}, exp) == []
    require_agreement("TEST", lay, "kv", {"kv": {0: buf}}, exp)


def test_wrong_layout_is_refused_naming_slot_and_plane() -> None:
    # the kernel keeps K then V per token; the layout says plane after plane
    lay = layout((Plane("p0", 8), Plane("p1", 8)))
    buf, exp = written([8, 8], [1], plane_major=False)
    bad = check_region(lay, "kv", {"kv": {0: buf}}, exp)
    assert [(m.slot, m.plane) for m in bad] == [(1, "p0"), (1, "p1")]
    assert bad[0].offset == 8 and bad[0].found_at == 16  # row 1 of page 0, row-major
    with pytest.raises(LayoutProbeError, match=r"TEST.*token slot 1 .*plane 'p0'") as ei:
        require_agreement("TEST", lay, "kv", {"kv": {0: buf}}, exp)
    assert ei.value.slot == 1 and ei.value.plane == "p0" and ei.value.backend == "TEST"
    assert "a page of 4 rows" in str(ei.value)


def test_slot_address_and_bad_inputs() -> None:
    lay = layout((Plane("p0", 8), Plane("p1", 4)))
    assert slot_address(lay, "kv", 0, 5, "p1") == ("kv", 48 + 8 * 4 + 1 * 4, 4)
    with pytest.raises(Exception, match="plane 'px'"):
        slot_address(lay, "kv", 0, 0, "px")
    with pytest.raises(Exception, match="holds 4 bytes per row"):
        check_region(lay, "kv", {"kv": {0: np.zeros(96, np.uint8)}}, {(0, "p1"): b"12345678"})


def test_doctor_reports_the_setting() -> None:
    from kvhandoff.doctor import Status, run_checks

    on, off = (next(r for r in run_checks(probes=False, layout_probe=v)
                    if r.name == "layout_probe") for v in (True, False))
    assert on.status is Status.OK
    assert off.status is Status.WARN and "KVHANDOFF_LAYOUT_PROBE=false" in off.summary


def test_stray_writes_are_found() -> None:
    from kvhandoff.integrations.layout_probe import stray_writes

    lay = layout((Plane("p0", 8), Plane("p1", 8)))
    buf, exp = written([8, 8], [0, 5], plane_major=True)
    assert stray_writes(lay, "kv", {"kv": {0: buf}}, exp, pages=2) == []
    buf[66:69] = 9  # page 1, plane p0, row 0 (slot 4): never written by the probe
    assert stray_writes(lay, "kv", {"kv": {0: buf}}, exp, pages=2) == [("kv", 66, 3)]
