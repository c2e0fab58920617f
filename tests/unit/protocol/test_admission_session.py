"""Issue 17's refusals at the handshake, on two `TransferSession`s wired in memory
(`kvhandoff.testing.memory.MemoryWire`, real wire format, fake clock): a peer whose pages break
this side's kernel page rules, the allocation policy (both must agree), admission (the
decode's reservation or free pages against what the request needs) and prompt-prefix
agreement. Every refusal fails the room on BOTH sides with the reason, before any transfer op
is posted and without touching the decode's pages.

Room ids double as the engine's tokens (small ints: the session compares tokens by identity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest

from kvhandoff.engine_sim.pattern import check_tokens, write_tokens
from kvhandoff.errors import FailureKind
from kvhandoff.kv_layout import LayoutSpec, PageRule, RuleKind
from kvhandoff.kv_layout.admission import AllocationPolicy, prefix_digest, prompt_digest
from kvhandoff.kv_layout.presets import mla_dsa_layout
from kvhandoff.protocol import events as ev
from kvhandoff.protocol import wire as P
from kvhandoff.protocol.effects import PostRecv, PostSend
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll, Role
from kvhandoff.testing.memory import MemoryWire, Side


@pytest.fixture(autouse=True, params=[False, True], ids=["two-sided", "one-sided"])
def one_sided(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each test runs on both data paths: sends and receives, and one-sided writes (the
    prefill writes into the decode's pages, the decode posts nothing)."""
    monkeypatch.setattr(MemoryWire, "writes", request.param)
    return bool(request.param)

SEQ = 40  # 2.5 pages of 16 tokens: 3 pages


def lay(page: int = 16) -> LayoutSpec:
    return mla_dsa_layout(model="tiny", num_layers=4, indexer_layer_ids=(1, 3),
                          page_size_tokens=page).without_page_rules()


def settings(policy: AllocationPolicy = AllocationPolicy.EARLY) -> Settings:
    return Settings(transport="inproc", heartbeat_interval_s=0.5, lease_s=5.0,
                    allocation_policy=policy)


class Run:
    """A prefill and a decode session in memory; records every effect executed."""

    def __init__(self, *, p_layout: LayoutSpec | None = None, d_layout: LayoutSpec | None = None,
                 p_policy: AllocationPolicy = AllocationPolicy.EARLY,
                 d_policy: AllocationPolicy = AllocationPolicy.EARLY) -> None:
        self.w = MemoryWire()
        self.p = self.w.add("prefill:1", Role.PREFILL, p_layout or lay(),
                            settings=settings(p_policy))
        self.d = self.w.add("decode:1", Role.DECODE, d_layout or lay(), settings=settings(d_policy))
        self.effects: list[Any] = []
        execute = self.w._execute

        def record(side: Side, eff: Any) -> None:
            self.effects.append(eff)
            execute(side, eff)

        self.w._execute = record  # type: ignore[method-assign]

    def open(self, room: int, *, prompt: np.ndarray | None = None, prefix: int = 0,
             d_prompt: Any = None, d_cached: Any = None, free_pages: int | None = None) -> None:
        p, d = self.p, self.d
        play, dlay = p.session.layout, d.session.layout
        src = np.arange(-(-SEQ // play.page_size_tokens), dtype=np.int64)
        for ri, reg in enumerate(play.regions):
            for lid in reg.layer_ids:
                if f"{reg.name}/{lid}" in p.buffers:  # 0-row layers have no buffer
                    write_tokens(p.buffers[f"{reg.name}/{lid}"], play, ri, lid, src, 0, SEQ, 7)
        self.w.feed(p, ev.OpenSender(room, room, {r.name: src for r in play.regions}, SEQ, 1,
                                     prompt_tokens=prompt))
        self.w.feed(d, ev.OpenReceiver(room, room, (("prefill:1", 0),)))
        dps = dlay.page_size_tokens
        self.dst = np.arange(-(-SEQ // dps), dtype=np.int64) + 5
        held = prefix // dps
        table = {r.name: self.dst if r.send_from.value == "start" else self.dst[held:]
                 for r in dlay.regions}
        self.w.feed(d, ev.ReceiverInit(room, room, table, SEQ, prefix, prompt=d_prompt,
                                       cached_prefix=d_cached, free_pages=free_pages))

    def finish(self, room: int) -> None:
        self.w.run()
        for lid in sorted({lid for r in self.p.session.layout.regions for lid in r.layer_ids}):
            self.w.feed(self.p, ev.LayerReady(room, room, lid))
        self.w.run()

    def data_ops(self) -> int:
        return sum(isinstance(e, PostSend | PostRecv) for e in self.effects)

    def decode_untouched(self) -> bool:
        return all(not np.any(b) for b in self.d.buffers.values())

    def bad_bytes(self) -> int:
        dlay = self.d.session.layout
        return sum(check_tokens(self.d.buffers[f"{reg.name}/{lid}"], dlay, ri, lid, self.dst, 0,
                                SEQ, 7)
                   for ri, reg in enumerate(dlay.regions) for lid in reg.layer_ids)

    def both_failed(self, room: int, kind: FailureKind) -> tuple[str, str]:
        pv, dv = self.p.views[room], self.d.views[room]
        assert (pv.state, dv.state) == (KVPoll.Failed, KVPoll.Failed), (pv, dv)
        assert pv.failure is not None and dv.failure is not None
        assert (pv.failure.kind, dv.failure.kind) == (kind, kind), (pv.failure, dv.failure)
        return pv.failure.reason, dv.failure.reason


def sent(run: Run, cls: type) -> list[Any]:
    return [m for _, _, m in run.w.sent if isinstance(m, cls)]


# ---------------------------------------------------------------------------- page rules


@pytest.mark.parametrize("ruled", ["prefill", "decode"])
def test_peer_pages_breaking_this_sides_kernel_rule_fail_both_sides(ruled: str) -> None:
    """The side with a FlashMLA-like rule (main_kv == 16 rows) refuses a peer with 8-token
    pages: the prefill answers the Hello with HelloReject, the decode refuses the HelloAck;
    either way both rooms fail naming region, rule and value, before any request."""
    rule = PageRule("main_kv", "FlashMLA", RuleKind.EQ, 16)
    strict, loose = lay(16).with_page_rules(rule), lay(8)
    run = Run(p_layout=strict if ruled == "prefill" else loose,
              d_layout=strict if ruled == "decode" else loose)
    run.open(1)
    run.w.run()
    reasons = run.both_failed(1, FailureKind.LAYOUT_MISMATCH)
    want = "peer region 'main_kv': rule FlashMLA: page == 16 rows; got 8 rows (page_size_tokens=8)"
    for reason in reasons:
        assert want in reason, reasons
    assert not sent(run, P.TransferRequest) and run.data_ops() == 0
    assert run.decode_untouched()


def test_pages_that_keep_the_rules_pair_as_before() -> None:
    rule = PageRule("main_kv", "FlashMLA", RuleKind.MULTIPLE_OF, 8)
    run = Run(p_layout=lay(16).with_page_rules(rule), d_layout=lay(8).with_page_rules(rule))
    run.open(2)
    run.finish(2)
    assert (run.p.views[2].state, run.d.views[2].state) == (KVPoll.Success, KVPoll.Success)
    assert run.bad_bytes() == 0


# ---------------------------------------------------------------------------- admission


def test_early_request_carries_the_reserved_pages_and_is_accepted() -> None:
    run = Run()
    run.open(3, prefix=16)  # one 16-token page cached: 2 new pages of 3
    run.finish(3)
    (req,) = sent(run, P.TransferRequest)
    assert req.allocation_policy == "early"
    assert req.reserved_pages == {"main_kv": 2, "indexer_k": 2} and req.free_pages is None
    assert (run.p.views[3].state, run.d.views[3].state) == (KVPoll.Success, KVPoll.Success)


def test_early_reservation_short_of_the_need_is_refused_before_any_byte() -> None:
    """A decode whose request says it reserved fewer pages than the sequence needs."""
    run = Run()
    run.w.hold(lambda f, t, m: isinstance(m, P.TransferRequest))
    run.open(4)
    run.w.run()
    ((to, req),) = run.w.held
    run.w.held.clear()
    short = msgspec.structs.replace(req, reserved_pages={"main_kv": 2, "indexer_k": 3})
    run.w.feed(to, ev.MessageReceived(short))
    run.w.run()
    p_reason, d_reason = run.both_failed(4, FailureKind.ADMISSION)
    want = ("admission: 40 tokens with 0 cached need 3 pages of 16 tokens (")
    assert want in p_reason and "the decode reserved 2" in p_reason
    assert want in d_reason and "the decode reserved 2" in d_reason
    assert not sent(run, P.TransferAccepted) and run.data_ops() == 0
    assert run.p.session.counters["bytes_sent"] == 0 and run.decode_untouched()


@pytest.mark.parametrize(("free", "ok"), [(3, True), (2, False)])
def test_prefill_complete_asks_with_its_free_pages(free: int, ok: bool) -> None:
    pc = AllocationPolicy.PREFILL_COMPLETE
    run = Run(p_policy=pc, d_policy=pc)
    run.open(5, free_pages=free)
    run.finish(5)
    (req,) = sent(run, P.TransferRequest)
    assert (req.allocation_policy, req.free_pages, req.reserved_pages) == (
        "prefill_complete", free, None)
    if ok:
        assert (run.p.views[5].state, run.d.views[5].state) == (KVPoll.Success, KVPoll.Success)
        assert run.bad_bytes() == 0
        return
    for reason in run.both_failed(5, FailureKind.ADMISSION):
        assert "need 3 pages of 16 tokens" in reason and "the decode has 2 free" in reason
    assert run.data_ops() == 0 and run.decode_untouched()


def test_allocation_policies_must_agree() -> None:
    run = Run(p_policy=AllocationPolicy.EARLY, d_policy=AllocationPolicy.PREFILL_COMPLETE)
    run.open(6, free_pages=100)
    run.finish(6)
    for reason in run.both_failed(6, FailureKind.ADMISSION):
        assert "allocation_policy: prefill=early decode=prefill_complete" in reason
    assert run.data_ops() == 0 and run.decode_untouched()


# ---------------------------------------------------------------------------- prefix agreement


def test_same_prompt_on_both_sides_is_accepted() -> None:
    toks = np.arange(1000, 1000 + SEQ)
    run = Run()
    run.open(7, prompt=toks, prefix=16, d_prompt=prompt_digest(toks, 16),
             d_cached=prefix_digest(toks, 16, 16))
    run.finish(7)
    (req,) = sent(run, P.TransferRequest)
    assert req.prompt is not None and len(req.prompt.pages) == 3 * 8
    assert (run.p.views[7].state, run.d.views[7].state) == (KVPoll.Success, KVPoll.Success)


def test_a_different_prompt_fails_both_sides_naming_the_first_differing_page() -> None:
    toks = np.arange(1000, 1000 + SEQ)
    other = toks.copy()
    other[35] += 1  # page 2 (tokens 32..47)
    run = Run()
    run.open(8, prompt=toks, d_prompt=prompt_digest(other, 16))
    run.finish(8)
    for reason in run.both_failed(8, FailureKind.ADMISSION):
        assert ("prompt mismatch: the prompt token ids differ; first differing page 2 "
                "(tokens 32..47)") in reason
    assert run.data_ops() == 0 and run.decode_untouched()


def test_a_cached_prefix_of_other_tokens_is_refused() -> None:
    toks = np.arange(1000, 1000 + SEQ)
    stale = toks.copy()
    stale[3] = 7
    run = Run()
    run.open(9, prompt=toks, prefix=32, d_prompt=prompt_digest(toks, 16),
             d_cached=prefix_digest(stale, 32, 16))
    run.finish(9)
    for reason in run.both_failed(9, FailureKind.ADMISSION):
        assert ("prefix mismatch: the decode's cached 32-token prefix is not the prompt's; "
                "first differing page 0 (tokens 0..15)") in reason
    assert run.data_ops() == 0


def test_prompt_digest_from_one_side_only_is_not_compared() -> None:
    """Prefix agreement is optional: compared only when both sides gave their prompt."""
    toks = np.arange(SEQ)
    run = Run()
    run.open(10, d_prompt=prompt_digest(toks, 16))
    run.finish(10)
    assert (run.p.views[10].state, run.d.views[10].state) == (KVPoll.Success, KVPoll.Success)


def test_prefill_rehashes_the_prompt_in_the_decodes_pages() -> None:
    """P != D pages: the decode hashes in its 8-token pages; the prefill (16) follows."""
    toks = np.arange(500, 500 + SEQ)
    other = toks.copy()
    other[9] = 0  # decode page 1 (tokens 8..15)
    run = Run(d_layout=lay(8))
    run.open(11, prompt=toks, d_prompt=prompt_digest(other, 8))
    run.finish(11)
    for reason in run.both_failed(11, FailureKind.ADMISSION):
        assert "first differing page 1 (tokens 8..15)" in reason


# ---------------------------------------------------------------------------- room stats


def test_room_stats_count_live_layers_only() -> None:
    """An indexer with a 0-row layer (SGLang's skip-topk placeholder): the per-region bytes
    in the room stats add up to the bytes that moved (was: every layer id counted)."""
    base = lay()
    regions = tuple(dataclasses.replace(r, empty_layers=(3,)) if r.name == "indexer_k" else r
                    for r in base.regions)
    sparse = dataclasses.replace(base, regions=regions)
    run = Run(p_layout=sparse, d_layout=sparse)
    run.open(12)
    run.finish(12)
    assert (run.p.views[12].state, run.d.views[12].state) == (KVPoll.Success, KVPoll.Success)
    for side in (run.p, run.d):
        stats = side.session.room_stats(12, 12)
        assert stats is not None
        assert sum(stats["bytes_per_region"].values()) == stats["bytes"], stats
        assert stats["bytes_per_region"]["indexer_k"] == SEQ * 132  # one live layer of two
