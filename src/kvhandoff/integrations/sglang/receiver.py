"""``KVHandoffKVReceiver``: the decode side of one SGLang request (see `conn` for the backend as
a whole)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVReceiver,
)

from kvhandoff.errors import ConfigError, FailureKind, KVHandoffError
from kvhandoff.integrations.sglang.conn import (
    KVHandoffKVManager,
    merge_states,
    release_open,
)
from kvhandoff.integrations.sglang.layout import (
    paged_state_pages,
    row_pages,
    swa_scale_pages,
    swa_start_pages,
    tail_pages,
)

log = logging.getLogger("kvhandoff.sglang")


class KVHandoffKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """Decode side of one request."""

    kv_mgr: KVHandoffKVManager

    def __init__(self, mgr: KVHandoffKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._handles: list[Any] = []
        self._agent_addrs: tuple[str, str | None, str | None, str | None] | None = None
        self._kv_peers: list[str] = []  # the KV agents of every prefill rank this rank reads

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed:
            return
        # SGLang's targets: one prefill rank, or (a non-MLA pool, prefill TP > decode TP)
        # every prefill rank holding a share of this rank's heads; SGLang's metadata buffers
        # (the aux room) come from the first only (`KVHandoffKVManager.sends_aux`)
        ranks = [int(self.target_tp_rank)]
        if not self.kv_mgr.is_mla_backend:
            ranks = [int(t) for t in (self.target_tp_ranks or ranks)]
        try:
            routes = [self.kv_mgr.route(self.bootstrap_addr, int(prefill_dp_rank), t,
                                        int(self.prefill_info.attn_tp_size)) for t in ranks]
        except KVHandoffError as e:
            self._local_failure(f"kvhandoff route lookup at {self.bootstrap_addr} failed: {e}")
            return
        self._agent_addrs = routes[0]
        self._kv_peers = [r[0] for r in routes]

    def _local_failure(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None, destination: Any = None,
                      device_kv_indices: Any = None) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        if destination is not None and getattr(destination, "value", destination) != "device":
            raise NotImplementedError("kvhandoff: host KV destinations are not supported")
        mgr = self.kv_mgr
        b = mgr.built
        ps = b.kv_layout.page_size_tokens
        prefix = int(decode_prefix_len or 0)
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        table: dict[str, Any] = dict.fromkeys(b.kv_regions, pages)
        problem = None

        def state(slot: int) -> Any:
            return None if state_indices is None or slot >= len(state_indices) \
                else state_indices[slot]

        if prefix % ps:
            problem = (f"decode_prefix_len: {prefix} is not a multiple of page_size={ps} "
                       f"(SGLang sends whole suffix pages)")
        elif b.dsa_slot is not None and len(pages):
            dsa = None if state_indices is None else state_indices[b.dsa_slot]
            if dsa is None or len(dsa) != len(pages):
                problem = (f"state_indices[{b.dsa_slot}] (DSA indexer): expected the "
                           f"{len(pages)} suffix pages, got {None if dsa is None else len(dsa)}")
            else:
                for name in b.indexer_regions:
                    table[name] = np.asarray(dsa, dtype=np.int64).reshape(-1)
        for p in b.paged_states:
            if problem is not None:
                break
            try:
                got = paged_state_pages(p, state(p.slot), pages)
            except ConfigError as e:
                problem = str(e)
            else:
                for name in p.regions:
                    table[name] = got
        starts: dict[str, int] = {}
        if problem is None and b.swa_slot is not None and len(pages):
            slot = b.swa_slot
            swa = None if state_indices is None or slot >= len(state_indices) \
                else state_indices[slot]
            try:
                start = swa_start_pages(len(pages), swa, f"state_indices[{slot}] (swa)")
                if b.swa_scale_slot is not None:
                    swa_scale_pages(state(b.swa_scale_slot), swa,
                                    f"state_indices[{b.swa_scale_slot}] (block_scale_swa)")
            except ConfigError as e:
                problem = str(e)
            else:
                for name in b.swa_regions:
                    table[name] = np.asarray(swa, dtype=np.int64).reshape(-1)
                    if start:
                        starts[name] = start * ps
        tail = np.zeros(0, np.int64)
        if problem is None and b.tail_slot is not None:
            try:
                tail = tail_pages(None if state_indices is None
                                  or b.tail_slot >= len(state_indices)
                                  else state_indices[b.tail_slot],
                                  f"state_indices[{b.tail_slot}] (dsa_tail)")
            except ConfigError as e:
                problem = str(e)
        rows: dict[str, np.ndarray | list[int]] | None = None
        if problem is None and b.row_states:
            try:
                rows = row_pages(b, state_indices)
            except ConfigError as e:
                problem = str(e)
        if problem is None and mgr.aux_agent is not None and aux_index is None:
            problem = "aux_index: missing (SGLang's metadata buffer slot)"
        if problem is not None:
            self._local_failure(f"kvhandoff: {problem}")
            return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
        if self.conclude_state == KVPoll.Failed or self._agent_addrs is None:
            return
        # after the metadata went out: it states this side's TP, so the prefill refuses the
        # room too, with the same reason
        refused = mgr.tp_refusal(int(self.prefill_info.attn_tp_size), int(mgr.attn_tp_size))
        if refused is not None:
            self._local_failure(refused)
            return
        kv_addr, aux_addr, tail_addr, state_addr = self._agent_addrs
        room = self.bootstrap_room
        assert room is not None
        mgr.forget_released_rooms()
        mgr.room_handles[int(room)] = self._handles  # SGLang's deferred release asks
        try:
            if len(pages):
                h = mgr.agent.receiver(room, peer=self._kv_peers if len(self._kv_peers) > 1
                                       else kv_addr)
                self._handles.append(h)
                h.init(table, len(pages) * ps, 0, region_starts=starts or None)
            if mgr.aux_agent is not None and aux_addr is not None:
                assert b.aux_layout is not None
                ah = mgr.aux_agent.receiver(room, peer=aux_addr)
                self._handles.append(ah)
                ah.init({r.name: [int(aux_index or 0)] for r in b.aux_layout.regions}, 1, 0)
            if len(tail) and mgr.tail_agent is not None and tail_addr is not None:
                assert b.tail_layout is not None
                th = mgr.tail_agent.receiver(room, peer=tail_addr)
                self._handles.append(th)
                th.init(dict.fromkeys((r.name for r in b.tail_layout.regions), tail),
                        len(tail), 0)
            if rows is not None and mgr.state_agent is not None and state_addr is not None:
                sh = mgr.state_agent.receiver(room, peer=state_addr)
                self._handles.append(sh)
                sh.init(rows, 1, 0)
        except KVHandoffError as e:
            for h in self._handles:
                h.abort(str(e))
            self._local_failure(f"kvhandoff: {e}")

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.request_status.get(self.bootstrap_room)
        if not self._handles or status == KVPoll.Failed:
            st = super().poll()
            if st == KVPoll.Failed:
                for h in self._handles:
                    h.abort(self.kv_mgr.failure_records.get(self.bootstrap_room, "failed"))
            return st
        st, reason = merge_states(self._handles)
        if st == KVPoll.Failed:
            if any(h.failure_kind == FailureKind.PEER_LOST for h in self._handles):
                # the prefill's agent is gone (silent, restarted): SGLang forgets that prefill
                # as its heartbeat checker would (cached rank address, its other open rooms),
                # and our routes, so the next request finds it where it restarted
                self.kv_mgr._handle_node_failure(self.bootstrap_addr)
            else:
                # its agents may have restarted on new addresses; look them up again
                self.kv_mgr.forget_routes(self.bootstrap_addr)
            self.kv_mgr.record_failure(self.bootstrap_room, reason or "failed")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            for h in self._handles:
                h.abort(reason or "failed")
        elif st == KVPoll.Success:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        else:
            return KVPoll.Transferring
        return super().poll()

    def clear(self) -> None:
        release_open(self._handles, "receiver cleared before the transfer ended")
        # SGLang clears a failed receiver (failure_exception) before it decides to hold the
        # pages: the rooms stay known to `is_abort_release_safe` until they are released
        self.kv_mgr.forget_released_rooms()
        super().clear()

    def abort(self) -> None:
        super().abort()
        for h in self._handles:
            h.abort("Aborted by AbortReq on the decode")
