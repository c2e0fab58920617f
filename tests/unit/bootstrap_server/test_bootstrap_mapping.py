"""TP/CP/PP mapping of decode ranks to prefill ranks, against a naive reference."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.bootstrap_server.mapping import prefill_axis_ranks, prefill_tp_ranks
from kvhandoff.errors import ConfigError


def test_equal_tp_is_one_to_one() -> None:
    assert [prefill_tp_ranks(d, 4, 4) for d in range(4)] == [[0], [1], [2], [3]]


def test_decode_tp_larger_shares_prefill_ranks() -> None:
    # D=8 decode ranks over P=2 prefill ranks: d*P//D
    assert [prefill_tp_ranks(d, 8, 2)[0] for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_decode_tp_smaller_reads_p_over_d_ranks() -> None:
    assert prefill_tp_ranks(0, 2, 8) == [0, 1, 2, 3]
    assert prefill_tp_ranks(1, 2, 8) == [4, 5, 6, 7]


def test_replicated_gives_exactly_one_spread_source() -> None:
    assert [prefill_tp_ranks(d, 8, 2, replicated=True) for d in range(4)] == [[0], [1], [0], [1]]
    assert prefill_tp_ranks(1, 2, 8, replicated=True) == [1]


@pytest.mark.parametrize(("d", "big_d", "big_p", "field"), [
    (0, 3, 2, "tp_size"), (4, 4, 4, "tp_rank"), (0, 0, 4, "tp_size"), (0, 2, 0, "prefill"),
])
def test_bad_tp_inputs_name_the_field(d: int, big_d: int, big_p: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        prefill_tp_ranks(d, big_d, big_p)


def test_axis_mapping() -> None:
    assert prefill_axis_ranks("cp", 1, 2, 2) == [1]
    assert prefill_axis_ranks("pp", 0, 1, 3) == [0, 1, 2]
    with pytest.raises(ConfigError, match="pp_size"):
        prefill_axis_ranks("pp", 0, 2, 4)


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.data())
def test_tp_mapping_covers_heads_like_a_naive_reference(big_d: int, big_p: int,
                                                        data: st.DataObject) -> None:
    d = data.draw(st.integers(0, big_d - 1))
    got = prefill_tp_ranks(d, big_d, big_p)
    # naive: decode rank d holds head fraction [d/D, (d+1)/D); prefill rank p holds
    # [p/P, (p+1)/P); d reads every p whose fraction overlaps its own
    want = [p for p in range(big_p) if p * big_d < (d + 1) * big_p and d * big_p < (p + 1) * big_d]
    assert got == want
    one = prefill_tp_ranks(d, big_d, big_p, replicated=True)
    assert len(one) == 1 and 0 <= one[0] < big_p
