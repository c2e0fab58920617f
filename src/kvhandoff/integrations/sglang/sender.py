"""``KVHandoffKVSender``: the prefill side of one SGLang request (see `conn` for the backend as
a whole)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVSender,
)

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.integrations.sglang.conn import (
    DecodeInfo,
    KVHandoffKVManager,
    merge_states,
    release_open,
)
from kvhandoff.integrations.sglang.layout import (
    paged_state_pages,
    row_pages,
    swa_scale_pages,
    swa_send_table,
    tail_pages,
)

log = logging.getLogger("kvhandoff.sglang")


class AllOf:
    """Complete when every one of its events is (``query()``): what the agent's event waiter
    polls for a chunk that must wait on several (the chunk's own event and SGLang's early-send
    event); it never synchronises."""

    __slots__ = ("events",)

    def __init__(self, events: list[Any]) -> None:
        self.events = tuple(events)

    def query(self) -> bool:
        return all(bool(e.query()) for e in self.events)

    def __repr__(self) -> str:
        return f"AllOf({list(self.events)!r})"


def all_of(events: list[Any]) -> Any:
    """None, the one event, or `AllOf` them."""
    evs = [e for e in events if e is not None]
    return None if not evs else evs[0] if len(evs) == 1 else AllOf(evs)


class KVHandoffKVSender(CommonKVSender):  # type: ignore[misc]
    """Prefill side of one request."""

    kv_mgr: KVHandoffKVManager
    _transfer_start_time: float | None
    _early_send_wait_event: Any  # set by SGLang's scheduler before an early send()

    def __init__(self, mgr: KVHandoffKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._chunks: list[np.ndarray] = []
        self._handles: list[Any] = []
        self._kv: Any = None  # the KV agent room's sender, once the first chunk opened it
        self._streamed = 0  # pages of `_chunks` the KV agent room has
        self._opened = False  # the last chunk came
        # The events the pages not yet marked ready wait on: each send()'s ``indices_event``
        # and, for SGLang's early send of a cached prefix under overlap scheduling, the event
        # it records on the forward stream (``_early_send_wait_event``: the previous step's
        # forward may still write those pages). The agent waits for all of them on its own
        # thread before reading (layers_ready(..., event)); the scheduler never blocks on them.
        self._events: list[Any] = []

    def _register_prefill_dp_rank(self) -> None:
        """SGLang's ``POST /register_dp_rank`` of this request (SGLang calls it from its
        constructor when the decode must look the prefill's dp rank up), made with this
        process's KVHANDOFF_AUTH_TOKEN (SGLang's own sends none). One try, as SGLang's; a
        refusal fails the request with the reason (SGLang's logs it and lets the decode wait).
        The rank posted is this rank's DP group (`conn.dp_group_of`: the replica's
        ``system_dp_rank`` under system DP, where SGLang's own posts attention-DP rank 0)."""
        from kvhandoff.integrations.sglang.bootstrap import write

        try:
            write("POST", f"http://{self.bootstrap_server_url}/register_dp_rank",
                  {"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.dp_group},
                  attempts=1, what=f"room {self.bootstrap_room}'s prefill dp rank")
        except ConfigError as e:
            log.error("kvhandoff SGLang prefill: %s", e)
            self.kv_mgr.conclude_failure(bootstrap_room=self.bootstrap_room,
                                         failure_reason=str(e))

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, indices_event: Any = None) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or self._opened:
            return
        kv_indices, _slice, is_last, skip = self._prepare_send_indices(kv_indices,
                                                                        state_indices)
        if skip:
            return
        # SGLang's event belongs to this one chunk (its common sender takes it the same way)
        early, self._early_send_wait_event = self._early_send_wait_event, None
        self._events += [e for e in (early, indices_event) if e is not None]
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        self._chunks.append(pages)
        self._record_transfer_indices(pages, state_indices)
        if is_last:
            self._open(state_indices)
        else:
            self._stream()

    def _stream(self) -> None:
        """A chunk before the last: its pages go to the KV agent room (opened by the first
        one) and every layer is marked ready, so the chunk moves now."""
        mgr = self.kv_mgr
        real = mgr.real_infos(self.bootstrap_room)
        pages = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int64)
        if not real or len(pages) == self._streamed:
            return  # a dummy rank, or nothing new: the last chunk decides
        total = {i.num_pages for i in real}
        if len(total) != 1 or len(pages) >= min(total):
            return  # the last chunk checks the counts and sends the rest
        b = mgr.built
        ps = b.kv_layout.page_size_tokens
        new = pages[self._streamed:]
        try:
            if self._kv is None:
                table: dict[str, Any] = dict.fromkeys(b.paged_regions, new)
                for name in (*b.indexer_regions, *b.swa_regions):
                    table[name] = np.zeros(0, np.int64)  # with the last chunk
                self._kv = mgr.agent.sender(self.bootstrap_room, pages=table,
                                            seq_len=min(total) * ps, chunk_end=len(pages) * ps,
                                            num_decode_ranks=len(real))
                self._handles.append(self._kv)
            else:
                self._kv.add_chunk(dict.fromkeys(b.paged_regions, new), len(pages) * ps)
            self._streamed = len(pages)
            self._kv.layers_ready(sorted({lid for r in b.kv_layout.regions
                                          for lid in r.layer_ids}), self._take_event())
        except KVHandoffError as e:
            self._fail(f"kvhandoff: {e}")

    def _take_event(self) -> Any:
        """The event guarding every page handed to the agent so far (and clears the list)."""
        ev, self._events = all_of(self._events), []
        return ev

    def _fail(self, reason: str) -> None:
        """Records `reason`, marks the room Failed and tells the decode ranks."""
        for h in self._handles:
            h.abort(reason)
        self.kv_mgr.conclude_failure(bootstrap_room=self.bootstrap_room, failure_reason=reason)

    def _open(self, state_indices: list[Any] | None) -> None:
        """Last chunk: the KV agent room gets the rest of its pages (or opens with the whole
        table when no earlier chunk streamed) and the indexer's, the aux room opens; every
        layer ready."""
        self._opened = True
        mgr = self.kv_mgr
        room = self.bootstrap_room
        real = mgr.real_infos(room)
        pages = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int64)
        if not real:  # a dummy rank for every decode rank of this room: nothing to send
            mgr.update_status(room, KVPoll.Success)
            return
        want = {i.num_pages for i in real}
        if want != {len(pages)}:
            self._fail(f"page count: prefill sends {len(pages)} pages, decode offered "
                       f"{sorted(want)}")
            return
        b = mgr.built
        # every room of the request reads pages the pending events guard (the aux slot and
        # the tail are written by the same forward)
        event = self._take_event()
        try:
            if len(pages):
                table: dict[str, Any] = dict.fromkeys(b.paged_regions, pages)
                for p in b.paged_states:  # they moved with each chunk's pages
                    paged_state_pages(p, None if state_indices is None
                                      or p.slot >= len(state_indices)
                                      else state_indices[p.slot], pages)
                if b.dsa_slot is not None:
                    dsa = None if state_indices is None else state_indices[b.dsa_slot]
                    if dsa is None or len(dsa) != len(pages):
                        raise ConfigError(
                            f"state_indices[{b.dsa_slot}] (DSA indexer): expected the "
                            f"{len(pages)} suffix pages, got "
                            f"{None if dsa is None else len(dsa)}")
                    for name in b.indexer_regions:
                        table[name] = np.asarray(dsa, dtype=np.int64).reshape(-1)
                if b.swa_slot is not None:
                    table.update(self._swa_table(state_indices, len(pages), real))
                ps = b.kv_layout.page_size_tokens
                if self._kv is None:
                    h = mgr.agent.sender(room, pages=table, seq_len=len(pages) * ps,
                                         num_decode_ranks=len(real))
                    self._handles.append(h)
                else:
                    h = self._kv
                    for name in b.paged_regions:
                        table[name] = pages[self._streamed:]
                    h.add_chunk(table, len(pages) * ps)
                h.layers_ready(sorted({lid for r in b.kv_layout.regions
                                       for lid in r.layer_ids}), event)
            if mgr.aux_agent is not None and mgr.sends_aux(real[0].attn_tp_size):
                if self.aux_index is None:
                    raise ConfigError("aux_index: the last chunk came without SGLang's "
                                      "metadata buffer index")
                assert b.aux_layout is not None
                ah = mgr.aux_agent.sender(
                    room, pages={r.name: [int(self.aux_index)] for r in b.aux_layout.regions},
                    seq_len=1, num_decode_ranks=len(real))
                self._handles.append(ah)
                ah.layers_ready([r.layer_ids[0] for r in b.aux_layout.regions], event)
            self._open_tail(state_indices, real, event)
            self._open_state(state_indices, real, event)
        except KVHandoffError as e:
            self._fail(f"kvhandoff: {e}")

    def _swa_table(self, state_indices: list[Any] | None, num_pages: int,
                   real: list[DecodeInfo]) -> dict[str, Any]:
        """The SWA regions' table (`layout.swa_send_table`), once the decode ranks' window
        starts at the same suffix page as this side's."""
        b = self.kv_mgr.built
        slot = b.swa_slot
        assert slot is not None
        where = f"state_indices[{slot}] (swa)"
        swa = None if state_indices is None or slot >= len(state_indices) \
            else state_indices[slot]
        n = 0 if swa is None else len(swa)
        theirs = {i.swa_pages for i in real}
        if theirs != {n}:
            raise ConfigError(f"swa: the prefill's window covers {n} pages, the decode's "
                              f"{sorted(theirs)} (another seq_len, window or page size)")
        if b.swa_scale_slot is not None:
            s = b.swa_scale_slot
            swa_scale_pages(None if state_indices is None or s >= len(state_indices)
                            else state_indices[s], swa, f"state_indices[{s}] (block_scale_swa)")
        table = swa_send_table(num_pages, swa, b.swa_capacity, where)
        return dict.fromkeys(b.swa_regions, table)

    def _open_state(self, state_indices: list[Any] | None, real: list[DecodeInfo],
                    event: Any) -> None:
        """The state room: the request's row of every row-state tensor and layer (the Mamba
        row, QSA's request-pool row)."""
        mgr, b = self.kv_mgr, self.kv_mgr.built
        if mgr.state_agent is None or not b.row_states or b.state_layout is None:
            return
        sh = mgr.state_agent.sender(self.bootstrap_room, pages=row_pages(b, state_indices),
                                    seq_len=1, num_decode_ranks=len(real))
        self._handles.append(sh)
        sh.layers_ready(sorted({lid for r in b.state_layout.regions for lid in r.layer_ids}),
                        event)

    def _open_tail(self, state_indices: list[Any] | None, real: list[DecodeInfo],
                   event: Any) -> None:
        """The kpool tail room: its live ring slots, when there are any (on both sides)."""
        mgr, b = self.kv_mgr, self.kv_mgr.built
        if mgr.tail_agent is None or b.tail_slot is None or b.tail_layout is None:
            return
        slot = b.tail_slot
        raw = None if state_indices is None or slot >= len(state_indices) \
            else state_indices[slot]
        pages = tail_pages(raw, f"state_indices[{slot}] (dsa_tail)")
        theirs = {i.tail_tokens for i in real}
        if theirs != {len(pages)}:
            raise ConfigError(f"dsa_tail: the prefill's request has {len(pages)} live kpool "
                              f"tail tokens, the decode's {sorted(theirs)} (another seq_len "
                              "or index_kpool)")
        if not len(pages):
            return
        th = mgr.tail_agent.sender(
            self.bootstrap_room, pages=dict.fromkeys((r.name for r in b.tail_layout.regions),
                                                     pages),
            seq_len=len(pages), num_decode_ranks=len(real))
        self._handles.append(th)
        th.layers_ready(sorted({lid for r in b.tail_layout.regions for lid in r.layer_ids}),
                        event)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.request_status.get(self.bootstrap_room)
        if not self._handles or status == KVPoll.Failed:
            st = super().poll()
            if st == KVPoll.Failed:  # e.g. the decode aborted: free the agent rooms now
                for h in self._handles:
                    h.abort(self.kv_mgr.failure_records.get(self.bootstrap_room, "failed"))
            return st
        st, reason = merge_states(self._handles)
        if st == KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, reason or "failed")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            for h in self._handles:
                h.abort(reason or "failed")
        elif st == KVPoll.Success:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        else:
            return KVPoll.Transferring
        return super().poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        """SGLang's per-request figures (its KV transfer latency and speed metrics), from the
        timelines of this request's agent rooms (docs/OPERATIONS.md): the latency from the KV
        room's opening on this side to its end, the bytes of every room (KV, aux, tail) that
        this rank sent. SGLang's own count from its page indices does not apply: the agents
        move suffix-only regions and planes, not whole SGLang pages."""
        mgr = self.kv_mgr
        metric = KVTransferMetric()
        if not self._handles:
            return metric
        rooms = [t for a in (mgr.agent, mgr.aux_agent, mgr.tail_agent, mgr.state_agent)
                 if a is not None
                 if (t := a.room_timings(self.bootstrap_room)) is not None]
        if rooms and rooms[0]["state"] == "Success" and rooms[0]["total_ms"] is not None:
            metric.transfer_latency_s = rooms[0]["total_ms"] / 1e3
        metric.transfer_total_bytes = sum(int(t["bytes"]) for t in rooms)
        return metric

    def clear(self) -> None:
        release_open(self._handles, "sender cleared before the transfer ended")
        super().clear()

    def abort(self) -> None:
        super().abort()
        if self._handles:
            for h in self._handles:
                h.abort("Aborted by AbortReq on the prefill")
        else:  # no agent room yet: tell the decode ranks through SGLang's status message
            self.kv_mgr.send_kv_status_message(
                targets=self.kv_mgr._room_notify_targets(self.bootstrap_room),
                bootstrap_room=self.bootstrap_room, status=KVPoll.Failed,
                failure_reason="Aborted by AbortReq on the prefill")
