"""The scheduler side of `KVHandoffConnector` (vLLM's scheduler process): which requests are
rooms, binding a prefill's room at the bootstrap server, how many tokens a decode loads, the
metadata each step hands the workers and what `request_finished` returns.

A sliding-window model (`groups`: one `SlidingWindowSpec` group) moves the pages in the window
only. vLLM frees a request's blocks that fell out of the window and puts its null block in
their place, on both engines: the prefill's table at `request_finished` (after vLLM freed what
the next token no longer sees) starts at ``remote_window_start`` (tokens, in the params); the
decode's table starts at the first block vLLM allocated for it, which is where its load
starts (its ``decode_prefix_len``), so no page is read from or written to the null block. A
decode that would need a token the prefill no longer holds (a layerwise decode computes the
last prompt token itself, so its window starts one token earlier) declines the room before it
announces any token, and computes the prompt itself (said in the log).

A hybrid model (several groups: full-attention and sliding-window layers) is one room over
every group's table: a full-attention group loads from the decode's prefix, a sliding-window
group from the first block vLLM allocated for it (the room's per-region start), so the decode
holds exactly the blocks vLLM alone would. ``remote_window_start`` is then the latest start of
the prefill's sliding-window groups, which every decode group's window must not precede.

A decode request of a remote prefill that vLLM queues (no slot yet) is held: recorded at
`on_new_request`, handed to the workers in the next step's ``holds`` (their agents hold its
room at the prefill ranks, `holds`), and in ``unholds`` once it leaves the queue (its blocks
allocated, in the step that opens its receiver, or ended while queued). Changes only; the
workers keep the set."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

from kvhandoff.errors import BootstrapNotFound, ConfigError, KVHandoffError
from kvhandoff.integrations.vllm.config import (
    ConnectorConfig,
    DeclineReq,
    HoldReq,
    KVHandoffMetadata,
    RecvReq,
    SendReq,
)
from kvhandoff.integrations.vllm.groups import state_table
from kvhandoff.integrations.vllm.layout import StateSpec
from kvhandoff.integrations.vllm.params import (
    RemotePrefill,
    decode_tp_size_of,
    readers_agree,
    room_of,
    split_addr,
)
from kvhandoff.runtime.tracing import mark, marks_enabled
from kvhandoff.settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvhandoff.vllm")


@dataclass
class _PrefillReq:
    request: Any
    room: int
    bind: Future[None] | None
    decode_tp: int | None = None  # the decode TP size the room is opened for (None: readers say)
    sent: bool = False  # a SendReq went out: the workers hold a sender


def _partial(rp: RemotePrefill, request: Any) -> bool:
    """A resumed request whose room covers a prefix of its prompt only (`params`)."""
    return rp.resume and rp.num_tokens < request.num_prompt_tokens


def _table(blocks: Any) -> tuple[list[int], int]:
    """One group's vLLM blocks -> (block ids, how many of them lead as the null block: the
    blocks a sliding window dropped)."""
    ids = [int(b.block_id) for b in blocks]
    lead = 0
    while lead < len(blocks) and blocks[lead].is_null:
        lead += 1
    if any(b.is_null for b in blocks[lead:]):
        raise ConfigError(f"KV cache block table: a null block after {lead} leading ones; "
                          "KVHandoffConnector moves tables whose dropped blocks lead")
    return ids, lead


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: VllmConfig, *,
                 sliding_window: int = 0, group_block_size: int = 0,
                 group_windows: tuple[int, ...] = (), group_extra: tuple[int, ...] = (),
                 states: tuple[StateSpec, ...] = ()) -> None:
        self.cfg = cfg
        self.window = sliding_window  # tokens (0: full attention)
        # several groups (hybrid allocator): per group its window (0: full attention) and
        # vLLM's extra retained tokens behind it
        self.windows = group_windows
        self.extra = group_extra or tuple(0 for _ in group_windows)
        self.states = {st.group: st for st in states}  # Mamba state groups (`groups`)
        self.block_size = int(vllm_config.cache_config.block_size)
        if (sliding_window or group_windows) and group_block_size:
            # the block of vLLM's KV cache group, in which it drops the window's blocks
            self.block_size = group_block_size
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.mla = bool(vllm_config.model_config.use_mla)
        self._prefills: dict[str, _PrefillReq] = {}
        self._async_loads: set[str] = set()  # decode requests loading between steps
        self._loaded: set[str] = set()  # timeline only: loaded, their first step not seen yet
        self._declined: dict[str, str] = {}  # decode request -> why it computes the prompt
        # decode: requests of a remote prefill vLLM has queued (no blocks yet), and the
        # changes not told to the workers yet (`on_new_request`)
        self._queued: set[str] = set()
        self._hold_new: dict[str, HoldReq] = {}
        self._hold_end: set[str] = set()
        self.kv_manager: Any = None
        self._meta = KVHandoffMetadata()
        self._binder: ThreadPoolExecutor | None = None
        self._client: Any = None
        # set once a bind found the engine at the server (or gave up waiting for it): from then
        # on "not registered" is an answer, not the first instants after start (`_bind_now`)
        self._engine_seen = False
        self._refused: dict[int, str] = {}  # room -> the server's last refusal, while retried
        self._closing = threading.Event()
        self.bootstrap_addr = ""
        self.host, self.port = "", 0
        if cfg.role == "prefill":
            assert cfg.bootstrap_url
            self.host, self.port = split_addr(cfg.bootstrap_url)
            self.bootstrap_addr = (f"[{self.host}]:{self.port}" if ":" in self.host
                                   else f"{self.host}:{self.port}")
            self._binder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvh-bind")
            # the client made now, not on the first request's bind (importing and building it
            # took 0.6 s of the first request on a loaded host)
            self._binder.submit(self._warm)

    # decode

    @staticmethod
    def _parsed(request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemotePrefill.parse(params)
        except ConfigError:
            return None

    def _remote(self, request: Request) -> RemotePrefill | None:
        """The remote prefill to load, None when there is none or this decode declines it
        (said in the log)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            rp = RemotePrefill.parse(params)
        except ConfigError as e:
            log.warning("request %s: bad kv_transfer_params, computing the prompt locally: %s",
                        request.request_id, e)
            return None
        if rp.resume and rp.num_tokens < request.num_prompt_tokens:
            pass  # a resumed request: the room covers the original prompt (`params`)
        elif rp.num_tokens != request.num_prompt_tokens:
            log.warning("request %s: kv_transfer_params.remote_num_tokens=%d but the prompt has "
                        "%d tokens; computing the prompt locally", request.request_id,
                        rp.num_tokens, request.num_prompt_tokens)
            return None
        if rp.decode_tp_size is not None and not readers_agree(
                rp.prefill_tp_size, rp.decode_tp_size, self.tp_size, replicated=self.mla):
            log.warning("request %s: the prefill (TP %d) opened room %d for a decode of TP %d, "
                        "this decode has TP %d (its ranks are not the readers the room waits "
                        "for); computing the prompt locally. Give the prefill request "
                        "kv_transfer_params.decode_tp_size=%d, or set the prefill's "
                        "decode_tp_size", request.request_id, rp.prefill_tp_size, rp.room,
                        rp.decode_tp_size, self.tp_size, self.tp_size)
            return None
        return rp

    def on_new_request(self, request: Request) -> None:
        """vLLM queued a new request. A decode request of a remote prefill is held at its
        prefill ranks (`holds`) until its blocks are allocated (its receiver opens) or it
        ends: while vLLM has no slot for it, the prefill's room outlives its bootstrap bound."""
        if self.cfg.role != "decode":
            return
        rp = self._parsed(request)
        if rp is not None:
            rid = request.request_id
            self._queued.add(rid)
            self._hold_new[rid] = HoldReq(room=rp.room, bootstrap_addr=rp.bootstrap_addr)

    def _unqueue(self, rid: str) -> None:
        """The request is no longer queued: its hold stops (never told if it was not yet)."""
        if rid in self._queued:
            self._queued.discard(rid)
            if self._hold_new.pop(rid, None) is None:
                self._hold_end.add(rid)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if self.cfg.role != "decode":
            return 0, False
        rp = self._remote(request)
        if rp is None:
            return 0, False
        mark("decode.matched", rid=request.request_id, room=rp.room)
        sync = self.cfg.load_mode == "layerwise"
        # layerwise: the last prompt token is computed in the step that loads the rest (a
        # resumed request computes its generated tokens after the room's: it loads it whole)
        upto = rp.num_tokens - (1 if sync and not _partial(rp, request) else 0)
        count = upto - num_computed_tokens
        if count <= 0:
            return 0, False
        if self.window or any(self.windows):
            # the first token vLLM keeps a block for once `upto` tokens are computed (its
            # sliding-window manager's rule), in each sliding-window group: the prefill must
            # still hold it
            kept = [(w, e) for w, e in zip(self.windows, self.extra, strict=True) if w] or [
                (self.window, 0)]
            first = min(max(0, upto - w + 1 - e) // self.block_size * self.block_size
                        for w, e in kept)
            if first < rp.window_start:
                why = (f"the decode's window starts at token {first}, the prefill kept its "
                       f"pages from token {rp.window_start} (load_mode={self.cfg.load_mode})")
                log.warning("request %s: not loaded, computing the prompt locally: %s",
                            request.request_id, why)
                self._declined[request.request_id] = why
                return 0, False
        return count, not sync

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if self.cfg.role == "prefill":
            if params.get("do_remote_decode") and rid not in self._prefills:
                try:
                    dtp = decode_tp_size_of(params, default=self.cfg.decode_tp_size,
                                            prefill_tp_size=self.tp_size)
                except ConfigError as e:
                    log.warning("request %s: no handoff (computed here, no kv_transfer_params "
                                "returned): %s", rid, e)
                    return
                room = room_of(self.cfg.engine_id, rid)
                mark("prefill.alloc", rid=rid, room=room)
                self._prefills[rid] = _PrefillReq(request=request, room=room,
                                                  bind=self._bind(room), decode_tp=dtp)
            return
        self._unqueue(rid)  # allocated: loaded, declined or computed here
        rp = self._remote(request)
        if rp is None or num_external_tokens <= 0:
            # declined (bad or mismatched params, or the whole prompt is cached here): the
            # prefill's room is aborted now, so its blocks are not held until a deadline
            told = rp or self._parsed(request)
            window_why = self._declined.pop(rid, None)
            if told is not None:
                why = window_why or (
                    "the decode holds the prompt in its prefix cache" if rp is not None
                    else "the decode declined the handoff and computes the prompt itself")
                self._meta.declines[rid] = DeclineReq(
                    room=told.room, bootstrap_addr=told.bootstrap_addr,
                    prefill_tp_size=told.prefill_tp_size, reason=why)
            params["do_remote_prefill"] = False  # one transfer per request
            return
        params["do_remote_prefill"] = False  # one transfer per request
        self._declined.pop(rid, None)
        sync = self.cfg.load_mode == "layerwise"
        local = rp.num_tokens - (1 if sync and not _partial(rp, request) else 0) \
            - num_external_tokens
        tables = self._group_tables(blocks.blocks, rp.num_tokens)
        # a sliding window: the load starts at the first block vLLM allocated (module doc)
        starts = [max(local, dropped * self.block_size) for _, dropped in tables]
        windowed = [s for (_, dropped), s in zip(tables, starts, strict=True) if dropped] or [
            starts[0]]
        refuse = None
        if min(windowed) < rp.window_start:
            refuse = (f"the decode's table starts at token {min(windowed)}, the prefill kept "
                      f"its pages from token {rp.window_start}")
        several = len(tables) > 1
        self._meta.recvs[rid] = RecvReq(
            room=rp.room, bootstrap_addr=rp.bootstrap_addr, block_ids=tables[0][0],
            num_tokens=rp.num_tokens, local_tokens=local if several else starts[0],
            load_tokens=local + num_external_tokens, sync=sync,
            prefill_tp_size=rp.prefill_tp_size, refuse=refuse,
            group_blocks=[ids for ids, _ in tables] if several else [],
            group_starts=starts if several else [])
        mark("decode.alloc", rid=rid, room=rp.room)
        if not sync:
            self._async_loads.add(rid)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._async_loads.discard(rid)
            mark("decode.recvd", rid=rid)
            if marks_enabled():
                self._loaded.add(rid)

    # prefill

    def _bind(self, room: int) -> Future[None]:
        assert self._binder is not None and self.cfg.bootstrap_url
        return self._binder.submit(self._bind_now, room)

    def _warm(self) -> None:
        """(bind thread) The bootstrap client built ahead of the first bind (not a call: one
        to a server not up yet would hold the thread, and the first bind, in its retries)."""
        try:
            self._bootstrap_client()
        except Exception as e:  # noqa: BLE001 - only a warm-up: the first bind says what failed
            log.debug("bootstrap client warm-up: %r", e)

    def _bind_now(self, room: int) -> None:
        """(bind thread) Bind the room. The workers' agents register on threads of their own,
        so in the first instants after start the server may not hold the engine yet: until a
        bind has found it, "engine not registered" is tried again within `bind_timeout_s`
        (the last refusal is the reason if it never comes)."""
        mark("prefill.bind", room=room)
        deadline = time.monotonic() + self.cfg.bind_timeout_s
        delay = 0.02
        try:
            while True:
                try:
                    self._bootstrap_client().bind_room(room, self.cfg.engine_id,
                                                       self.cfg.dp_rank)
                    break
                except BootstrapNotFound as e:
                    left = deadline - time.monotonic()
                    if self._engine_seen or "is not registered" not in str(e) or left <= 0:
                        self._engine_seen = True
                        raise
                    if room not in self._refused:
                        log.info("room %d: %s; trying again for up to %.1f s (the workers' "
                                 "agents register on threads of their own)", room, e, left)
                    self._refused[room] = str(e)
                    if self._closing.wait(min(delay, left)):
                        raise
                    delay = min(delay * 2, 0.5)
        finally:
            self._refused.pop(room, None)
        self._engine_seen = True
        mark("prefill.bound", room=room)

    def _bootstrap_client(self) -> Any:
        from kvhandoff.bootstrap_server.client import BootstrapClient

        if self._client is None:
            # the settings' auth_token (extra config or KVHANDOFF_AUTH_TOKEN): binding is a
            # write, refused without the server's token
            url = self.cfg.bootstrap_url or ""
            self._client = BootstrapClient.from_settings(Settings(**{
                **self.cfg.settings, "bootstrap_url": url if "://" in url else f"http://{url}"}))
        return self._client

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._loaded:  # timeline: the first step of a loaded request
            for rid in self._loaded & set(scheduler_output.num_scheduled_tokens):
                mark("decode.step", rid=rid,
                     tokens=scheduler_output.num_scheduled_tokens[rid])
                self._loaded.discard(rid)
        if self.cfg.role == "prefill":
            for rid in scheduler_output.preempted_req_ids or ():
                p = self._prefills.get(rid)
                if p is not None and p.sent:
                    p.sent = False
                    self._meta.resets[rid] = "prefill request preempted; its blocks were freed"
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                p = self._prefills.get(rid)
                if p is None or p.sent:
                    continue
                req = p.request
                if req.num_computed_tokens + n < req.num_prompt_tokens:
                    continue  # not the last prompt chunk yet
                tables = self._tables(rid, int(req.num_prompt_tokens))
                ids, dropped = tables[0]
                several = len(tables) > 1
                p.sent = True
                mark("prefill.step", rid=rid, room=p.room)
                self._meta.sends[rid] = SendReq(
                    room=p.room, block_ids=ids, num_tokens=int(req.num_prompt_tokens),
                    decode_tp_size=p.decode_tp, dropped_blocks=dropped,
                    group_blocks=[t for t, _ in tables] if several else [],
                    group_dropped=[d for _, d in tables] if several else [])
        self._keep_loads_unzeroed(scheduler_output)
        if self._hold_new or self._hold_end:
            # what changed since the last step (a request admitted in the step it arrived in
            # is never held); the workers keep the set
            self._meta.holds, self._hold_new = self._hold_new, {}
            self._meta.unholds, self._hold_end = sorted(self._hold_end), set()
        self._meta.idle = not scheduler_output.total_num_scheduled_tokens
        meta, self._meta = self._meta, KVHandoffMetadata()
        return meta

    def _keep_loads_unzeroed(self, scheduler_output: SchedulerOutput) -> None:
        """Takes this step's layerwise loads' blocks out of vLLM's zeroing list. vLLM zeroes
        ``new_block_ids_to_zero`` on the compute stream before the forward (where its KV cache
        mixes precisions, or holds SSM state); the prefill's writes start once the workers open
        the room, so a zeroing still queued could land after them. vLLM leaves an async load's
        blocks out itself (``get_loaded_kv_cache_group_ids``), a synchronous load's it lists."""
        zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if not zero:
            return
        loaded = {b for r in self._meta.recvs.values() if r.sync
                  for b in r.loaded_blocks(self.block_size)}
        if loaded:
            scheduler_output.new_block_ids_to_zero = [b for b in zero if b not in loaded] or None

    def _tables(self, rid: str, num_tokens: int = 0) -> list[tuple[list[int], int]]:
        """Per KV cache group, the request's block ids and how many lead as the null block
        (`_table`; a state group's: `_group_tables`)."""
        if self.kv_manager is None:
            raise ConfigError("KVHandoffConnector: the scheduler never bound its KV cache manager")
        return self._group_tables(self.kv_manager.get_blocks(rid).blocks, num_tokens)

    def _group_tables(self, groups: Any, num_tokens: int) -> list[tuple[list[int], int]]:
        """Per group `_table`; a Mamba state group's is its block holding the state after
        `num_tokens` tokens (`groups.state_table`; none found: empty, and the room fails
        naming the group)."""
        out: list[tuple[list[int], int]] = []
        for i, blocks in enumerate(groups):
            st = self.states.get(i)
            if st is None:
                out.append(_table(blocks))
                continue
            try:
                out.append((state_table(blocks, num_tokens, st), 0))
            except KVHandoffError as e:
                log.error("KV cache group %d: %s", i, e)
                out.append(([], 0))
        return out

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        mark("scheduler.finished", rid=rid)
        self._declined.pop(rid, None)
        self._unqueue(rid)  # ended while queued (aborted): its hold stops
        if rid in self._async_loads:
            # finished (aborted) while its KV is loading: vLLM keeps the blocks until
            # finished_recving; abort the room so that comes now
            self._meta.aborts[rid] = f"decode request ended with {request.status.name}"
        p = self._prefills.pop(rid, None)
        if p is None:
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                RequestStatus.FINISHED_STOPPED)
        if not p.sent:
            # no sender was opened: nothing reads the blocks
            self._meta.aborts[rid] = "request finished before its prompt was computed"
            return False, None
        bind_error = self._bind_error(p) if ok else None
        if not ok or bind_error:
            reason = bind_error or f"prefill request ended with {request.status.name}"
            log.warning("request %s (room %d): no handoff: %s", rid, p.room, reason)
            self._meta.aborts[rid] = reason
            return True, None  # freed once the workers' rooms are released
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": rid,
            "remote_room": p.room,
            "remote_bootstrap_addr": self.bootstrap_addr,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": int(request.num_prompt_tokens),
            "tp_size": self.tp_size,
        }
        if p.decode_tp is not None:
            out["decode_tp_size"] = p.decode_tp
        mark("prefill.params", rid=rid, room=p.room)
        if self.window or any(self.windows):
            # vLLM freed the blocks out of the window just before this call: the pages the
            # prefill still holds start here, in its latest sliding-window group (module
            # docstring)
            out["remote_window_start"] = max(
                d for _, d in self._tables(rid, int(request.num_prompt_tokens))) * self.block_size
        if self.states and (request.kv_transfer_params or {}).get("kvhandoff_state_cut"):
            # the room holds the state before the last prompt token: the decode computes it
            out["kvhandoff_resume"] = True
        return True, out

    def _bind_error(self, p: _PrefillReq) -> str | None:
        if p.bind is None:
            return "room not bound"
        try:
            p.bind.result(timeout=self.cfg.bind_timeout_s)
        except FutureTimeout:
            refused = self._refused.get(p.room)
            return (f"binding room {p.room} at the bootstrap server took more than "
                    f"{self.cfg.bind_timeout_s} s"
                    + (f" (its last answer: {refused})" if refused else ""))
        except Exception as e:  # noqa: BLE001 - any failure means: no handoff, said why
            return (f"binding room {p.room} at the bootstrap server failed: "
                    f"{type(e).__name__}: {e}")
        return None

    def close(self) -> None:
        self._closing.set()
        if self._binder is not None:
            self._binder.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
