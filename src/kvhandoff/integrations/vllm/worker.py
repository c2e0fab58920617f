"""The worker side of `KVHandoffConnector` (each vLLM worker process): registering the KV caches
(backend, layout, layout probe, the agent), opening senders and receivers per step, each layer's
`layer_ready` / `wait_for_layer`, and what a step reports finished or failed.

DSA models (an ``indexer`` region, `groups`): vLLM 0.33's DeepSeek-V3.2 / GLM-5 attention
(``DeepseekV32Attention``) calls its MLA kernels directly, without the per-layer connector hooks
(``save_kv_layer``, ``wait_for_layer_load``), and its indexer reads the indexer cache before its
MLA layer would wait. So, for such a layout: the prefill hands over every layer no
``save_kv_layer`` reported at ``wait_for_save`` (the forward has written them all), and a
decode's layerwise load is waited for whole in ``start_load_kv``, before the forward reads a
page (said once in the log); the per-layer waits then return at once."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.integrations.vllm.backends import Backend, dtype_identity, layer_scales, resolve
from kvhandoff.integrations.vllm.config import (
    ConnectorConfig,
    DeclineReq,
    KVHandoffMetadata,
    RecvReq,
)
from kvhandoff.integrations.vllm.groups import GroupPlan, plan_group
from kvhandoff.integrations.vllm.holds import RoomHolds
from kvhandoff.integrations.vllm.lanes import choose_lane
from kvhandoff.integrations.vllm.layout import (
    INDEXER_SCALE_FP32,
    INDEXER_SCALE_UE8M0X4,
    VllmLayout,
    build_layout,
    with_state_regions,
)
from kvhandoff.integrations.vllm.params import (
    decode_readers,
    readers_of,
)
from kvhandoff.integrations.vllm.probe import probe_layer
from kvhandoff.integrations.vllm.stats import StatsRecorder
from kvhandoff.kv_layout import TPSplit
from kvhandoff.runtime.tracing import mark, marks_enabled
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvhandoff.transfer import Receiver

log = logging.getLogger("kvhandoff.vllm")

INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"  # vLLM's DSA indexer (DeepseekV32IndexerBackend)
# A step with no token scheduled while loads run (every request waits for its KV): vLLM steps
# again at once, a busy loop of the engine core and this worker that holds this process's GIL
# and a core, which the agent's control thread (same process) needs too (on a loaded 2-core
# host a handshake's answer waited tens to hundreds of ms to be read). Such a step's
# get_finished waits this long for a load to end instead (woken at once when one does); a
# request arriving at an engine that only waits for loads is scheduled at most this much later.
IDLE_LOAD_WAIT_S = 0.005


@dataclass
class _Load:
    rid: str
    spec: RecvReq
    receiver: Any
    pages: list[int]  # vLLM block ids that were to be loaded (reported on failure)
    failed: str | None = None


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.vl: VllmLayout | None = None
        self.agent: Any = None
        self._lock = threading.Lock()
        self._senders: dict[str, Any] = {}
        self._stale: list[Any] = []  # senders of preempted requests, until released
        self._unsent: set[str] = set()  # requests whose sender could not be opened
        self._step_senders: list[Any] = []
        self._readied: set[int] = set()  # layer ids handed over in this step
        self._finished: set[str] = set()  # requests vLLM finished (senders may still run)
        self._loads: dict[str, _Load] = {}  # async loads
        self._sync: list[_Load] = []  # this step's layerwise loads
        self._errors: set[int] = set()
        self._declined: list[Any] = []  # aborted receivers of declined rooms, until released
        self.probe_report: str | None = None
        self.stats = StatsRecorder(cfg.role)
        self.tp_rank, self.tp_size = 0, 1
        self.replicated = False  # every region whole on every TP rank (MLA)
        self.plan: GroupPlan | None = None
        self._device: Any = None  # of the KV caches (CUDA events of wait_for_save)
        self._warned_whole = False
        self._idle_step = False  # this step schedules no token (`IDLE_LOAD_WAIT_S`)
        # several KV cache groups: vLLM takes no block-level load errors (its block ids are
        # per group), so a failed (async) load is reported by request (`failed_recving`)
        self._failed_loads: set[str] = set()
        self.holds: RoomHolds | None = None  # decode: rooms of queued requests (`holds`)

    def layers(self, names: Any = None) -> dict[str, Any]:
        """vLLM's attention layers of the KV cache groups (or of `names`), from the forward
        context (empty when no model registered any: tools and tests driving the worker side
        alone)."""
        ctx = getattr(self.vllm_config.compilation_config, "static_forward_context", {}) or {}
        if names is None:
            names = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names]
        return {n: ctx[n] for n in names if n in ctx and hasattr(ctx[n], "get_attn_backend")}

    @staticmethod
    def _check_indexers(layers: dict[str, Any]) -> None:
        """The indexer caches must be written by the DSA indexer whose page the connector
        knows (keys then scales, `layout`)."""
        found = sorted({lay.get_attn_backend().get_name() for lay in layers.values()})
        unknown = [n for n in found if n != INDEXER_BACKEND]
        if unknown:
            raise ConfigError(f"indexer caches: written by {unknown}; KVHandoffConnector knows "
                              f"the page of {INDEXER_BACKEND} only (fp8 keys, then fp32 scales)")
        shuffled = sorted(n for n, lay in layers.items()
                          if getattr(lay, "uses_shuffled_layout", False))
        if shuffled:
            raise ConfigError(f"indexer caches {shuffled[:2]}: their reader expects the "
                              "shuffled value layout (ROCm's aiter tiles), which "
                              "KVHandoffConnector does not describe")

    def _backend(self, layers: dict[str, Any], mla: bool) -> Backend:
        """The attention backend writing these caches: vLLM's layers say (one backend for all),
        else ``attention_backend`` of the extra config; nothing else is guessed."""
        found = sorted({lay.get_attn_backend().get_name() for lay in layers.values()})
        named = self.cfg.attention_backend
        if len(found) > 1:
            raise ConfigError(f"attention backends: the layers use {found}; KVHandoffConnector "
                              "moves caches written by one backend")
        if found and named and named != found[0]:
            raise ConfigError(f"kv_connector_extra_config.attention_backend: {named!r}, but "
                              f"vLLM's layers use {found[0]!r}")
        name = found[0] if found else named
        if name is None:
            raise ConfigError("attention backend: no attention layer in vLLM's forward context "
                              "says which backend writes these caches, and "
                              "kv_connector_extra_config.attention_backend does not name one")
        isas = {getattr(lay, "isa", None) for lay in layers.values()} - {None}
        b = resolve(name, cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
                    isa=next(iter(isas)) if len(isas) == 1 else None)
        if b.mla != mla:
            raise ConfigError(f"attention backend {b.name}: {'an MLA' if b.mla else 'a GQA'} "
                              f"backend, but the KV cache spec is "
                              f"{'MLA' if mla else 'full attention'}")
        return b

    def _probe(self, settings: Settings, layers: dict[str, Any], kv_caches: dict[str, Any],
               total_kv_heads: int, tp_rank: int, tp_size: int) -> str:
        """The layout probe on one layer of each region (`probe`); its report for the log."""
        vl = self.vl
        assert vl is not None
        if not settings.layout_probe:
            return (f"layout probe off (layout_probe=false): the {vl.backend.name} layout is "
                    "not checked against its kernel")
        cache_dtype = str(self.vllm_config.cache_config.cache_dtype)
        if cache_dtype in vl.backend.quantized_dtypes:
            return (f"layout probe: {vl.backend.name} with {cache_dtype} rows not probed (the "
                    "write quantises; one opaque row per token, moved as whole pages)")
        roles = self.plan.roles if self.plan is not None else None
        by_id = {((roles[n].region if roles else ""), lid): n
                 for n, lid in vl.layer_ids.items() if roles is None or n in roles}
        reports = []
        for reg in vl.layout.regions:
            if reg.name in vl.state_regions:
                # no attention kernel writes it: vLLM's state block, moved whole (its dtypes,
                # shapes and padding are in the plane's name, compared at the handshake)
                reports.append(f"{reg.name}: a state block (no attention kernel's page), moved "
                               "whole")
                continue
            if reg.name in vl.indexer_regions:
                # its write (indexer_k_quant_and_cache) quantises, on CUDA only: nothing to
                # compare raw bytes with; the DSA kernel fixes its page at 64 rows on both
                # sides, so the region always moves whole pages and its interior never matters
                reports.append(f"{reg.name}: not probed ({INDEXER_BACKEND} quantises its "
                               "writes); moves whole pages")
                continue
            name = by_id[(reg.name if roles else ""), reg.live_layer_ids[0]]
            reports.append(probe_layer(
                vl, name, kv_caches[name], layers.get(name), total_kv_heads=total_kv_heads,
                tp_rank=tp_rank, tp_size=tp_size,
                cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
                input_dtype=self.vllm_config.model_config.dtype))
        return "; ".join(reports)

    def register(self, kv_caches: dict[str, Any]) -> None:
        from kvhandoff.transfer import TransferAgent

        vc = self.vllm_config
        plan = self.plan = plan_group(self.kv_cache_config)
        mla = plan.mla
        mc = vc.model_config
        pc = vc.parallel_config
        tp_rank = _tp_rank()
        model = model_label(vc)
        layers = self.layers(plan.main_layers)
        backend = self._backend(layers, mla)
        # per-tensor fp8 caches: the layers' scales are part of the layout identity
        kv_dtype = dtype_identity(str(vc.cache_config.cache_dtype), str(plan.dtype), backend,
                                  layer_scales(layers))
        self._check_indexers(self.layers(plan.indexer_layers))
        moved = set(plan.main_layers) | set(plan.indexer_layers)
        mine = {n: t for n, t in kv_caches.items() if n in moved}
        self._device = next((getattr(t, "device", None) for t in mine.values()), None)
        total = 1 if mla else int(mc.get_total_num_kv_heads())
        tp_size = int(pc.tensor_parallel_size)
        self.vl = build_layout(mine, backend=backend, block_size=plan.block_size,
                               kv_dtype=kv_dtype, model=model, total_kv_heads=total,
                               tp_rank=tp_rank, tp_size=tp_size, roles=plan.roles,
                               num_layers=plan.num_layers,
                               indexer_scale=indexer_scale_format())
        backend.check_block(self.vl.layout.page_size_tokens)
        if plan.states:
            self.vl = with_state_regions(
                self.vl, kv_caches, plan.states,
                num_blocks=int(self.kv_cache_config.num_blocks), num_layers=plan.num_layers)
            mine.update({n: kv_caches[n] for st in plan.states for n in st.layers
                         if n in kv_caches})
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # as the bootstrap server maps decode ranks to prefill ranks for this layout
        self.replicated = all(r.tp_split is TPSplit.REPLICATED for r in self.vl.layout.regions)
        kw: dict[str, Any] = dict(self.cfg.settings)
        if self.cfg.role == "prefill":
            kw["bootstrap_url"] = self.cfg.bootstrap_url
        settings, lane = choose_lane(Settings(**kw), self._memory(mine))
        log.info("KVHandoffConnector %s: %s", self.cfg.role, lane)
        self.probe_report = self._probe(settings, layers, mine, total, tp_rank, tp_size)
        if settings.layout_probe and "not probed" not in self.probe_report:
            log.info("KVHandoffConnector %s: %s", self.cfg.role, self.probe_report)
        else:
            log.warning("KVHandoffConnector %s: %s", self.cfg.role, self.probe_report)
        self.agent = TransferAgent(
            self.cfg.role, self.vl.layout, self.vl.buffers, settings,
            engine_id=self.cfg.engine_id, dp_rank=self.cfg.dp_rank, dp_size=self.cfg.dp_size,
            tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size))
        self.stats.transport = str(self.agent.status()["transport"]["kind"])
        if plan.group_regions:
            log.info("KVHandoffConnector %s: %d KV cache groups (vLLM's hybrid allocator), each "
                     "its own region: %s", self.cfg.role, len(plan.group_regions),
                     ", ".join(f"{r} ({self._group_kind(i, w)})" for i, (r, w) in enumerate(
                         zip(plan.group_regions, plan.group_windows, strict=True))))
        log.info("KVHandoffConnector %s: %s, %s pages, %d layers, page %d tokens (whole pages "
                 "where both sides use this size), agent %s", self.cfg.role, backend.name,
                 self.vl.order, len(self.vl.layer_ids), self.vl.layout.page_size_tokens,
                 self.agent.address)

    def _group_kind(self, group: int, window: int) -> str:
        """What a group's region holds, for the log."""
        st = self.plan.state_of(group) if self.plan is not None else None
        if st is not None:
            return (f"{st.kind} state, {len(st.layers)} layers, one block of "
                    f"{st.page_bytes} B per request and layer, mamba_cache_mode {st.cache_mode}")
        return f"window {window}" if window else "full attention"

    @staticmethod
    def _memory(kv_caches: dict[str, Any]) -> str:
        """Where the caches live ("host" or "cuda"; one kind for all, else refused)."""
        from kvhandoff.buffers.devsum import memory_kind

        kinds = {memory_kind(t).kind for t in kv_caches.values()}
        if len(kinds) > 1:
            raise ConfigError(f"KV caches: some in {sorted(kinds)[0]} memory, some in "
                              f"{sorted(kinds)[1]} memory; KVHandoffConnector moves one kind")
        return kinds.pop() if kinds else "host"

    # ---- per step

    def start_step(self, meta: KVHandoffMetadata) -> None:
        if self.agent is None:
            return
        vl = self.vl
        assert vl is not None
        self._step_senders = []
        self._readied = set()
        self._idle_step = meta.idle
        if meta.holds or meta.unholds:
            self._hold_queued(meta)
        for rid, reason in meta.resets.items():
            snd = self._senders.pop(rid, None)
            if snd is not None:  # not reported: the request runs on and sends again
                snd.abort(reason)
                self.stats.forget(snd)
                self._stale.append(snd)
        for rid, reason in meta.aborts.items():
            snd = self._senders.get(rid)
            if snd is not None:
                snd.abort(reason)
            self._finished.add(rid)
            ld = self._loads.get(rid)
            if ld is not None and ld.failed is None:
                ld.failed = reason  # the request is gone: nothing to report as load errors
                ld.receiver.abort(reason)
        for rid, s in meta.sends.items():
            try:
                readers = None if s.decode_tp_size is None else decode_readers(
                    self.tp_rank, self.tp_size, s.decode_tp_size, replicated=self.replicated)
                if readers == 0:  # a replicated cache read from another prefill rank
                    self._unsent.add(rid)
                    continue
                sender = self.agent.sender(s.room, pages=self._send_pages(s),
                                           seq_len=s.num_tokens, num_decode_ranks=readers,
                                           request_id=rid)
            except KVHandoffError as e:
                # no room: nothing will read the blocks; vLLM may free them once finished
                log.error("request %s (room %d): cannot open the sender: %s", rid, s.room, e)
                self._unsent.add(rid)
                self.stats.refused()
                continue
            self._senders[rid] = sender
            mark("prefill.sender", rid=rid, room=s.room)
            self.stats.watch(sender)
            self._step_senders.append(sender)
        for rid, d in meta.declines.items():
            self._decline(rid, d)
        self._sync = []
        for rid, r in meta.recvs.items():
            ld = self._open_load(rid, r)
            mark("decode.receiver", rid=rid, room=r.room)
            if r.sync:
                self._sync.append(ld)
            else:
                self._loads[rid] = ld

    def _hold_queued(self, meta: KVHandoffMetadata) -> None:
        """The step's changes to the queued requests whose rooms this rank holds (`holds`);
        before any receiver of the step opens, so a request admitted now is no longer held."""
        if self.holds is None:
            self.holds = RoomHolds(self.agent)
        self.holds.update(meta.holds, meta.unholds)

    def _send_pages(self, s: Any) -> Any:
        """The sender's pages: one table (one group), or one per group's region, each cut to
        the prompt's pages (a table that is exactly that long is one from token 0)."""
        vl = self.vl
        assert vl is not None
        if not s.group_blocks:
            return vl.expand_blocks(self._send_table(s.block_ids, s.dropped_blocks))
        return self._group_pages(
            [self._send_table(ids, d) for ids, d in zip(s.group_blocks, s.group_dropped,
                                                         strict=True)], s.num_tokens)

    def _group_pages(self, tables: list[list[int]], num_tokens: int) -> dict[str, Any]:
        """Per group's region, its expanded table cut to the pages of `num_tokens` tokens."""
        vl, plan = self.vl, self.plan
        assert vl is not None and plan is not None
        if len(tables) != len(plan.group_regions):
            raise KVHandoffError(f"{len(tables)} block tables for the "
                                 f"{len(plan.group_regions)} KV cache groups")
        n = -(-num_tokens // vl.layout.page_size_tokens)
        return {region: (_state_pages(ids, n) if region in vl.state_regions
                         else vl.expand_blocks(ids)[:n])
                for region, ids in zip(plan.group_regions, tables, strict=True)}

    def _send_table(self, block_ids: list[int], dropped: int) -> list[int]:
        """The sender's table from token 0: the blocks a sliding window dropped (vLLM's null
        block, repeated) stand as distinct blocks the request does not hold. They are never
        read: every decode's load starts after them (`scheduler`: a decode whose window starts
        earlier declines the room), and the agent reads only from the decode's prefix (or the
        region's start) on."""
        if not dropped:
            return list(block_ids)
        held = set(block_ids[dropped:])
        spare = (b for b in range(int(self.kv_cache_config.num_blocks)) if b not in held)
        return [next(spare) for _ in range(dropped)] + list(block_ids[dropped:])

    def _decline(self, rid: str, d: DeclineReq) -> None:
        """Aborts a room this decode does not load: the receiver tells each prefill rank it
        would have read, once found and handshaken (the prefill frees the blocks then)."""
        try:
            rcv = self._receiver(rid, d.room, d.bootstrap_addr, d.prefill_tp_size)
        except KVHandoffError as e:
            log.warning("request %s (room %d): declined, but the prefill cannot be told: %s",
                        rid, d.room, e)
            return
        rcv.abort(d.reason)
        self._declined = [r for r in self._declined if not r.released] + [rcv]
        log.info("request %s (room %d): not loaded (%s); the prefill's room is aborted", rid,
                 d.room, d.reason)

    def _receiver(self, rid: str, room: int, bootstrap_addr: str, prefill_tp_size: int
                  ) -> Receiver:
        """The agent's receiver of `room`, telling each prefill rank it reads how many decode
        ranks read that rank (`readers_of`)."""
        readers = readers_of(self.tp_rank, self.tp_size, prefill_tp_size,
                             replicated=self.replicated)
        rcv: Receiver = self.agent.receiver(room, bootstrap_addr, request_id=rid,
                                            readers=readers)
        return rcv

    def _open_load(self, rid: str, r: RecvReq) -> _Load:
        vl = self.vl
        assert vl is not None
        bs = int(self.vllm_config.cache_config.block_size)
        if r.group_blocks and self.plan is not None:  # the groups' block (`groups`)
            bs = self.plan.block_size
        loaded = r.loaded_blocks(bs)
        try:
            receiver: Any = self._receiver(rid, r.room, r.bootstrap_addr, r.prefill_tp_size)
        except KVHandoffError as e:
            receiver = _NoRoom(r.room, f"cannot open the receiver: {e}")
        ld = _Load(rid=rid, spec=r, receiver=receiver, pages=list(loaded))
        if isinstance(receiver, _NoRoom):
            self.stats.refused()
            self._fail(ld, receiver.failure)
            return ld
        self.stats.watch(receiver)
        if r.refuse is not None:
            self._fail(ld, r.refuse)
            return ld
        if vl.state_regions and r.prefill_tp_size != self.tp_size:
            self._fail(ld, f"the prefill has TP {r.prefill_tp_size}, this decode TP "
                           f"{self.tp_size}: KVHandoffConnector moves Mamba state (regions "
                           f"{', '.join(vl.state_regions)}) between engines of one TP size "
                           "only (a rank's state is its share of the heads)")
            return ld
        try:
            if r.group_blocks:
                plan = self.plan
                assert plan is not None
                starts = dict(zip(plan.group_regions, r.group_starts, strict=True))
                # a state region: the page of the last loaded token, the block of its state
                last = (r.num_tokens - 1) // vl.layout.page_size_tokens \
                    * vl.layout.page_size_tokens
                starts.update(dict.fromkeys(vl.state_regions, last))
                receiver.init(self._group_pages(r.group_blocks, r.num_tokens), r.num_tokens,
                              decode_prefix_len=r.local_tokens,
                              region_starts={reg: s for reg, s in starts.items()
                                             if s > r.local_tokens})
            else:
                receiver.init(vl.expand_blocks(r.block_ids), r.num_tokens,
                              decode_prefix_len=r.local_tokens)
        except KVHandoffError as e:
            self._fail(ld, f"receiver init: {e}")
        return ld

    def _fail(self, ld: _Load, reason: str) -> None:
        if ld.failed is not None:
            return
        ld.failed = reason
        by_request = self._by_request()
        log.error("request %s (room %d): KV load failed, %s: %s", ld.rid, ld.spec.room,
                  "the request reported" if by_request else f"{len(ld.pages)} blocks reported",
                  reason)
        ld.receiver.abort(reason)
        with self._lock:
            if by_request:
                self._failed_loads.add(ld.rid)
            else:
                self._errors.update(ld.pages)

    def _by_request(self) -> bool:
        """Load failures go to vLLM by request, not by block: several KV cache groups."""
        return bool(self.plan is not None and self.plan.group_regions)

    def start_load(self) -> None:
        """Before the forward: a DSA layout's layerwise loads are waited for whole here (module
        docstring), since vLLM's DSA attention never calls the per-layer waits."""
        if not self._sync or self.vl is None or not self.vl.indexer_regions:
            return
        if not self._warned_whole:
            self._warned_whole = True
            log.info("KVHandoffConnector decode: DSA layout (regions %s): a layerwise load is "
                     "waited for whole before the forward (vLLM's DSA attention calls no "
                     "per-layer connector hooks)", ", ".join(self.vl.indexer_regions))
        for lid in self._all_layers():
            self._wait_sync(lid)

    def _all_layers(self) -> list[int]:
        vl = self.vl
        assert vl is not None
        return sorted({lid for r in vl.layout.regions for lid in r.live_layer_ids})

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._sync or self.vl is None:
            return
        lid = self.vl.layer_ids.get(layer_name)
        if lid is None:
            return
        self._wait_sync(lid)

    def _wait_sync(self, lid: int) -> None:
        for ld in self._sync:
            if ld.failed is not None:
                continue
            try:
                ok = ld.receiver.wait_for_layer(lid, timeout=self.cfg.layer_timeout_s)
            except KVHandoffError as e:
                self._fail_sync(ld, f"layer {lid}: {type(e).__name__}: {e}")
                continue
            if ok is False:  # the pre-typed-errors API
                self._fail_sync(ld, f"layer {lid}: {ld.receiver.failure or 'timed out'}")

    def _fail_sync(self, ld: _Load, reason: str) -> None:
        self._fail(ld, reason)
        # vLLM recomputes into these blocks: nothing may still write into them
        if not ld.receiver.wait_released(self.cfg.layer_timeout_s):
            log.error("room %d: pages not released after the failure", ld.spec.room)

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        if not self._step_senders or self.vl is None:
            return
        lid = self.vl.layer_ids.get(layer_name)
        if lid is None or lid in self._readied:
            return
        self._ready(lid, getattr(kv_layer, "device", None))

    def finish_forward(self) -> None:
        """``wait_for_save``: the forward wrote every layer; hand over those no
        ``save_kv_layer`` reported (vLLM's DSA attention calls none, module docstring; a full
        CUDA graph replays without the per-layer hooks, as vLLM runs an engine whose connector
        does not ask for piecewise graphs)."""
        if not self._step_senders or self.vl is None:
            return
        if marks_enabled():
            mark("prefill.forward_end", rooms=[s.room for s in self._step_senders])
        for lid in self._all_layers():
            if lid not in self._readied:
                self._ready(lid, self._device)

    def _ready(self, lid: int, device: Any) -> None:
        """`layer_ready` of every sender of the step. CUDA: with an event recorded on the
        current stream, so layer_ready returns at once (the agent waits for the event on its
        own thread) and the forward never blocks on the copy engine."""
        self._readied.add(lid)
        ev = None
        if getattr(device, "type", None) == "cuda":
            import torch

            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(torch.cuda.current_stream(device))
        for s in self._step_senders:
            try:
                if ev is None:
                    s.layer_ready(lid)
                else:
                    s.layer_ready(lid, ev)
            except KVHandoffError as e:  # an aborted room: the forward goes on
                log.warning("room %d: layer_ready(%d): %s", s.room, lid, e)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        self._sync = []
        self._step_senders = []
        self._readied = set()
        self._finished |= finished_req_ids
        sent: set[str] = set()
        for rid in [r for r in self._senders if r in self._finished]:
            s = self._senders[rid]
            if s.poll() in (KVPoll.Success, KVPoll.Failed) and s.released:
                if s.poll() is KVPoll.Failed:
                    log.warning("request %s (room %d): handoff failed: %s", rid, s.room,
                                s.failure)
                del self._senders[rid]
                sent.add(rid)
                mark("prefill.released", rid=rid, room=s.room)
        for rid in self._unsent & self._finished:
            self._unsent.discard(rid)
            sent.add(rid)
        self._finished = {r for r in self._finished if r in self._senders or r in self._unsent}
        self._stale = [s for s in self._stale if not s.released]
        if self._idle_step and self._loads and not sent:
            self._idle_step = False
            first = next(iter(self._loads.values()))
            first.receiver.wait_released(IDLE_LOAD_WAIT_S)
        recvd: set[str] = set()
        for rid, ld in list(self._loads.items()):
            st = ld.receiver.poll()
            if st is KVPoll.Failed and ld.failed is None:
                self._fail(ld, ld.receiver.failure or "failed")
            if st in (KVPoll.Success, KVPoll.Failed) and ld.receiver.released:
                del self._loads[rid]
                recvd.add(rid)
                mark("decode.loaded", rid=rid, room=ld.spec.room)
        return (sent or None), (recvd or None)

    def take_failed_loads(self, done: set[str]) -> set[str]:
        """The failed loads among `done` (the requests reported in ``finished_recving``), for
        vLLM's ``failed_recving`` (several groups: `_fail`)."""
        with self._lock:
            out = self._failed_loads & done
            self._failed_loads -= out
        return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        if self.holds is not None:
            self.holds.close()
        if self.agent is not None:
            self.agent.close()


def _state_pages(ids: list[int], n: int) -> Any:
    """A state region's page table of `n` pages: the request's state block (`ids`, its one
    block, `groups.state_table`) as the last page, the pages before it distinct other block
    ids that are never read or written (the region starts at its last page)."""
    import numpy as np

    if len(ids) != 1:
        raise KVHandoffError(f"a state group's table holds {len(ids)} blocks, expected the "
                             "request's one state block")
    state = int(ids[0])
    filler = [b for b in range(n) if b != state][:n - 1]
    return np.asarray([*filler, state], dtype=np.int64)


class _NoRoom:
    """Stands in for a receiver that could not be opened: terminal, Failed, nothing in flight."""

    def __init__(self, room: int, failure: str) -> None:
        self.room = room
        self.failure = failure
        self.released = True

    def poll(self) -> KVPoll:
        return KVPoll.Failed

    def abort(self, reason: str = "") -> None:
        return

    def wait_released(self, timeout: float) -> bool:
        return True

    def wait_for_layer(self, layer_id: int, timeout: float) -> bool:
        raise KVHandoffError(self.failure)


# keys of a model's config that name where it was read from or what wrote it, not what it is
_NOT_ARCHITECTURE = frozenset({"_name_or_path", "name_or_path", "_commit_hash",
                               "transformers_version", "_attn_implementation_autoset"})


def model_label(vllm_config: Any) -> str:
    """The model both sides of a handoff must serve, as the layout's ``model``: the served
    model name (``--served-model-name``, else the model as given to vLLM) and a digest of the
    architecture config (the model's config.json without where it was read from, plus the
    dtype vLLM runs it in). A prefill serving another model or another architecture is refused
    at the handshake with both labels. Weights are not compared (two checkpoints of one
    architecture under one name pass; ``kvhandoff verify`` compares the outputs)."""
    import hashlib
    import json

    mc = vllm_config.model_config
    name = mc.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    name = str(name or mc.model)
    cfg = {k: v for k, v in mc.hf_config.to_dict().items() if k not in _NOT_ARCHITECTURE}
    cfg["vllm_dtype"] = str(mc.dtype)
    canon = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return f"vllm:{name} config:{hashlib.sha256(canon.encode()).hexdigest()[:16]}"


def indexer_scale_format() -> str:
    """What the 4 scale bytes of a DSA indexer row mean on this machine: the format vLLM's
    indexer write is told to use (``mqa_logits_use_mx_scales``: packed UE8M0 on SM100, where
    the MQA logits kernels take MX scales; fp32 elsewhere). Same bytes, another meaning: it is
    part of the layout both sides compare (`layout`)."""
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
    except ImportError:  # a vLLM without it writes fp32 scales
        return INDEXER_SCALE_FP32
    return INDEXER_SCALE_UE8M0X4 if mqa_logits_use_mx_scales() else INDEXER_SCALE_FP32


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0  # no initialised TP group (a single worker, tests)

