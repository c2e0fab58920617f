"""Issue 17's refusals through real agents (control on real ZMQ sockets on 127.0.0.1; the
in-process transport, and tcp on 127.0.0.1 for the capacity refusal): a layout that breaks its
kernel page rules is refused at start; a request that cannot fit, or whose prompt differs,
fails both handles with `AdmissionRefused` before any byte moves. The handshake-level cases
are in test_admission_session.py (in memory)."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.buffers.bufferset import allocate
from kvhandoff.errors import AdmissionRefused, ConfigError, FailureKind
from kvhandoff.kv_layout import preset
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll
from kvhandoff.transfer import TransferAgent

from .conftest import WAIT_S, Pair, layers_of

SEQ = 100  # 7 pages of 16
PC = {"allocation_policy": "prefill_complete"}


def test_agent_refuses_to_start_with_a_layout_breaking_its_kernel_page_rules() -> None:
    spec = preset("glm-5.3", page_size_tokens=32)
    with pytest.raises(ConfigError) as e:
        TransferAgent("prefill", spec, allocate(spec, 1), Settings(transport="inproc"))
    msg = str(e.value)
    assert "region 'main_kv': rule FlashMLA: page == 64 rows; got 32 rows" in msg
    assert "region 'indexer_k': rule DSA indexer paged-MQA: page == 64 rows; got 32 rows" in msg
    # the same layout without its rules (a deliberate P != D experiment) starts
    ok = spec.without_page_rules()
    TransferAgent("prefill", ok, allocate(ok, 1), Settings(transport="inproc")).close()


def _open(pr: Pair, room: int, *, prompt: np.ndarray | None = None,
          d_prompt: np.ndarray | None = None, free_pages: int | None = None):  # type: ignore[no-untyped-def]
    p, d = pr.prefill, pr.decode
    src = p.pool.alloc(-(-SEQ // p.layout.page_size_tokens))
    for reg in p.layout.regions:
        for lid in reg.layer_ids:
            p.agent.buffers.array(reg.name, lid)[:] = 0xAB
    s = p.agent.sender(room, pages=src, seq_len=SEQ, prompt_tokens=prompt)
    dst = d.pool.alloc(-(-SEQ // d.layout.page_size_tokens))
    rv = d.agent.receiver(room, peer=p.agent.address)
    rv.init(dst, SEQ, prompt_tokens=d_prompt, free_pages=free_pages)
    return s, rv


def _decode_untouched(pr: Pair) -> bool:
    d = pr.decode
    return all(not np.any(d.agent.buffers.array(reg.name, lid))
               for reg in d.layout.regions for lid in reg.layer_ids)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_prefill_complete_short_of_free_pages_fails_both_before_any_byte(  # type: ignore[no-untyped-def]
        pair, transport: str) -> None:
    pr = pair(prefill_settings=PC, decode_settings=PC, transport=transport)
    s, rv = _open(pr, 1, free_pages=6)
    with pytest.raises(AdmissionRefused) as e:
        rv.wait_for_layer(0, WAIT_S)
    assert "admission: 100 tokens with 0 cached need 7 pages of 16 tokens" in str(e.value)
    assert "the decode has 6 free" in str(e.value)
    assert s.wait(WAIT_S) is KVPoll.Failed and s.failure_kind is FailureKind.ADMISSION
    assert "the decode has 6 free" in (s.failure or "")
    for lid in layers_of(pr.prefill.layout):  # ready layers of a refused room move nothing
        s.layer_ready(lid)
    assert rv.wait_released(WAIT_S) and s.wait_released(WAIT_S)
    assert _decode_untouched(pr)
    assert pr.prefill.agent.status()["counters"]["bytes_sent"] == 0


def test_prefill_complete_with_room_enough_hands_off(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair(prefill_settings=PC, decode_settings=PC)
    s, rv = _open(pr, 2, free_pages=7)
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
        assert rv.wait_for_layer(lid, WAIT_S)
    assert rv.wait(WAIT_S) is KVPoll.Success and s.wait(WAIT_S) is KVPoll.Success
    assert not _decode_untouched(pr)


def test_prefill_complete_needs_the_free_pages(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair(prefill_settings=PC, decode_settings=PC)
    d = pr.decode
    rv = d.agent.receiver(3, peer=pr.prefill.agent.address)
    with pytest.raises(ConfigError, match="free_pages: required"):
        rv.init(d.pool.alloc(7), SEQ)
    rv.abort()


def test_policy_mismatch_fails_both_naming_both_values(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair(decode_settings=PC)
    s, rv = _open(pr, 4, free_pages=100)
    assert rv.wait(WAIT_S) is KVPoll.Failed and s.wait(WAIT_S) is KVPoll.Failed
    for h in (rv, s):
        assert h.failure_kind is FailureKind.ADMISSION
        assert "allocation_policy: prefill=early decode=prefill_complete" in (h.failure or "")
    assert _decode_untouched(pr)


def test_prompt_mismatch_fails_both_naming_the_first_differing_page(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair()
    toks = np.arange(7, 7 + SEQ)
    other = toks.copy()
    other[50] = 1  # page 3 (tokens 48..63)
    s, rv = _open(pr, 5, prompt=toks, d_prompt=other)
    with pytest.raises(AdmissionRefused, match=r"first differing page 3 \(tokens 48..63\)"):
        rv.wait_for_layer(0, WAIT_S)
    assert s.wait(WAIT_S) is KVPoll.Failed and "first differing page 3" in (s.failure or "")
    assert _decode_untouched(pr)


def test_same_prompt_hands_off(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair()
    toks = np.arange(7, 7 + SEQ)
    s, rv = _open(pr, 6, prompt=toks, d_prompt=toks.copy())
    for lid in layers_of(pr.prefill.layout):
        s.layer_ready(lid)
    assert rv.wait(WAIT_S) is KVPoll.Success, rv.failure
    assert s.wait(WAIT_S) is KVPoll.Success


def test_prompt_tokens_of_the_wrong_length_are_refused_naming_the_field(pair) -> None:  # type: ignore[no-untyped-def]
    pr = pair()
    p = pr.prefill
    with pytest.raises(ConfigError, match="prompt_tokens: 99 token ids for seq_len=100"):
        p.agent.sender(7, pages=p.pool.alloc(7), seq_len=SEQ, prompt_tokens=np.arange(99))
