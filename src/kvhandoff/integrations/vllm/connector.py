"""`KVHandoffConnector`: kvhandoff as a vLLM v1 KV connector (vLLM 0.33).

Pick it with::

    --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
        "kv_connector_module_path": "kvhandoff.integrations.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_url": "http://127.0.0.1:8998"}}'

What maps to what (docs/VLLM.md has the whole flow):

- a prefill request (``do_remote_decode``) is a room: ``room_of(engine_id, request_id)``, bound
  to this engine's dp rank at the bootstrap server when the request gets its blocks;
- its block ids are the page table; at the step that schedules its last prompt chunk the
  workers open a `Sender`; each attention layer's ``save_kv_layer`` is that layer's
  ``layer_ready`` (the layer goes out while the next ones compute);
- ``request_finished`` keeps the blocks (returns True) and hands the decode the params it needs;
  the workers report the request in ``finished_sending`` once the room is terminal and its pages
  released (Success, or Failed after the decode gave up), and only then does vLLM free them;
- a decode request (``do_remote_prefill``) announces the prompt tokens beyond its local prefix
  hit in ``get_num_new_matched_tokens``; ``update_state_after_alloc`` records its blocks; the
  workers open a `Receiver` (``decode_prefix_len`` = the local hit, so only the suffix moves);
- ``load_mode = "layerwise"`` (default): a synchronous load: each attention layer's
  ``wait_for_layer_load`` is that layer's ``wait_for_layer`` (per-layer streaming into the
  step that computes the last prompt token); ``"async"``: the load runs between steps and the
  request comes back through ``finished_recving``;
- a failed load (any typed kvhandoff failure: peer lost, checksum, layout, timeout ...) reports
  exactly the request's loaded blocks through ``get_block_ids_with_load_errors``, so vLLM's
  ``kv_load_failure_policy`` (``fail`` / ``recompute``) applies.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.integrations.vllm.layout import VllmLayout, build_layout
from kvhandoff.integrations.vllm.params import RemotePrefill, room_of, split_addr
from kvhandoff.settings import Settings
from kvhandoff.state_machine import KVPoll

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvhandoff.vllm")

LOAD_MODES = ("layerwise", "async")
_EXTRA_KEYS = {"bootstrap_url", "load_mode", "layer_timeout_s", "bind_timeout_s", "settings"}


# ---------------------------------------------------------------------------- metadata


@dataclass
class SendReq:
    """Open a sender: the request's whole page table (vLLM block ids) and prompt length."""

    room: int
    block_ids: list[int]
    num_tokens: int


@dataclass
class RecvReq:
    """Open a receiver into `block_ids` (the whole table from token 0); the first
    `local_tokens` tokens are a local prefix hit, `load_tokens` tokens come from the prefill."""

    room: int
    bootstrap_addr: str
    block_ids: list[int]
    num_tokens: int  # the sequence the prefill sends
    local_tokens: int
    load_tokens: int  # local_tokens + announced external tokens
    sync: bool  # layerwise: waited on inside this step's forward


@dataclass
class KVHandoffMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    sends: dict[str, SendReq] = field(default_factory=dict)
    recvs: dict[str, RecvReq] = field(default_factory=dict)
    aborts: dict[str, str] = field(default_factory=dict)  # finished request id -> reason
    # preempted prefills: their blocks were freed, the room restarts at the next last chunk
    resets: dict[str, str] = field(default_factory=dict)


@dataclass
class _Config:
    role: str  # "prefill" | "decode"
    engine_id: str
    dp_rank: int
    dp_size: int
    bootstrap_url: str | None
    load_mode: str
    layer_timeout_s: float
    bind_timeout_s: float
    settings: dict[str, Any]

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> _Config:
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        extra = dict(kt.kv_connector_extra_config or {})
        unknown = set(extra) - _EXTRA_KEYS
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)} "
                              f"(known: {sorted(_EXTRA_KEYS)})")
        if kt.kv_role == "kv_producer":
            role = "prefill"
        elif kt.kv_role == "kv_consumer":
            role = "decode"
        else:
            raise ConfigError(f"kv_transfer_config.kv_role: KVHandoffConnector needs kv_producer "
                              f"(prefill) or kv_consumer (decode), got {kt.kv_role!r}")
        url = extra.get("bootstrap_url")
        if role == "prefill":
            if not isinstance(url, str) or not url:
                raise ConfigError("kv_connector_extra_config.bootstrap_url: a prefill engine "
                                  "needs its bootstrap server (e.g. http://127.0.0.1:8998)")
            split_addr(url)
        mode = extra.get("load_mode", "layerwise")
        if mode not in LOAD_MODES:
            raise ConfigError(f"kv_connector_extra_config.load_mode: expected one of "
                              f"{LOAD_MODES}, got {mode!r}")
        settings = extra.get("settings", {})
        if not isinstance(settings, dict):
            raise ConfigError("kv_connector_extra_config.settings: expected an object of "
                              "kvhandoff Settings fields")
        bad = sorted(set(settings) - set(Settings.model_fields))
        if bad:
            raise ConfigError(f"kv_connector_extra_config.settings: unknown kvhandoff settings "
                              f"{bad}")
        pc = vllm_config.parallel_config
        return cls(role=role, engine_id=str(kt.engine_id), dp_rank=int(pc.data_parallel_rank),
                   dp_size=int(pc.data_parallel_size), bootstrap_url=url, load_mode=mode,
                   layer_timeout_s=_pos(extra, "layer_timeout_s", 30.0),
                   bind_timeout_s=_pos(extra, "bind_timeout_s", 5.0), settings=settings)


def _pos(extra: dict[str, Any], key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key}: expected a number > 0, got {v!r}")
    return float(v)


# ---------------------------------------------------------------------------- connector


class KVHandoffConnector(KVConnectorBase_V1):
    """kvhandoff's vLLM v1 KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._cfg = _Config.of(vllm_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self._cfg, vllm_config)
        else:
            self._worker = _WorkerSide(self._cfg, vllm_config, kv_cache_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # save_kv_layer / wait_for_layer_load run per layer, between graph pieces
        return True

    # ---- scheduler side

    def _s(self) -> _SchedulerSide:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().kv_manager = kv_cache_manager

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    # ---- worker side

    def _w(self) -> _WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVHandoffMetadata)
        self._w().start_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # rooms open in bind_connector_metadata, before the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._w().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        return  # sends are asynchronous; vLLM keeps the blocks until finished_sending

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # ---- for tests and status

    @property
    def layout(self) -> VllmLayout | None:
        return self._worker.vl if self._worker is not None else None

    @property
    def agent(self) -> Any:
        return self._worker.agent if self._worker is not None else None


# ---------------------------------------------------------------------------- scheduler


@dataclass
class _PrefillReq:
    request: Any
    room: int
    bind: Future[None] | None
    sent: bool = False  # a SendReq went out: the workers hold a sender


class _SchedulerSide:
    def __init__(self, cfg: _Config, vllm_config: VllmConfig) -> None:
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._prefills: dict[str, _PrefillReq] = {}
        self._async_loads: set[str] = set()  # decode requests loading between steps
        self.kv_manager: Any = None
        self._meta = KVHandoffMetadata()
        self._binder: ThreadPoolExecutor | None = None
        self._client: Any = None
        self.bootstrap_addr = ""
        self.host, self.port = "", 0
        if cfg.role == "prefill":
            assert cfg.bootstrap_url
            self.host, self.port = split_addr(cfg.bootstrap_url)
            self.bootstrap_addr = (f"[{self.host}]:{self.port}" if ":" in self.host
                                   else f"{self.host}:{self.port}")
            self._binder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvh-bind")

    # decode

    def _remote(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            rp = RemotePrefill.parse(params)
        except ConfigError as e:
            log.warning("request %s: bad kv_transfer_params, computing the prompt locally: %s",
                        request.request_id, e)
            return None
        if rp.num_tokens != request.num_prompt_tokens:
            log.warning("request %s: kv_transfer_params.remote_num_tokens=%d but the prompt has "
                        "%d tokens; computing the prompt locally", request.request_id,
                        rp.num_tokens, request.num_prompt_tokens)
            return None
        return rp

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if self.cfg.role != "decode":
            return 0, False
        rp = self._remote(request)
        if rp is None:
            return 0, False
        if self.cfg.load_mode == "async":
            count = rp.num_tokens - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        # layerwise: the last prompt token is computed in the step that loads the rest
        count = rp.num_tokens - 1 - num_computed_tokens
        return (count, False) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if self.cfg.role == "prefill":
            if params.get("do_remote_decode") and rid not in self._prefills:
                room = room_of(self.cfg.engine_id, rid)
                self._prefills[rid] = _PrefillReq(request=request, room=room,
                                                  bind=self._bind(room))
            return
        rp = self._remote(request)
        if rp is None:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            return
        sync = self.cfg.load_mode == "layerwise"
        local = rp.num_tokens - (1 if sync else 0) - num_external_tokens
        (ids,) = blocks.get_block_ids()
        self._meta.recvs[rid] = RecvReq(
            room=rp.room, bootstrap_addr=rp.bootstrap_addr, block_ids=list(ids),
            num_tokens=rp.num_tokens, local_tokens=local,
            load_tokens=local + num_external_tokens, sync=sync)
        if not sync:
            self._async_loads.add(rid)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._async_loads.discard(rid)

    # prefill

    def _bind(self, room: int) -> Future[None]:
        assert self._binder is not None and self.cfg.bootstrap_url
        return self._binder.submit(self._bind_now, room)

    def _bind_now(self, room: int) -> None:
        from kvhandoff.bootstrap_server.client import BootstrapClient

        if self._client is None:
            url = self.cfg.bootstrap_url or ""
            self._client = BootstrapClient(url if "://" in url else f"http://{url}")
        self._client.bind_room(room, self.cfg.engine_id, self.cfg.dp_rank)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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
                ids = self._block_ids(rid)
                p.sent = True
                self._meta.sends[rid] = SendReq(room=p.room, block_ids=ids,
                                                num_tokens=int(req.num_prompt_tokens))
        meta, self._meta = self._meta, KVHandoffMetadata()
        return meta

    def _block_ids(self, rid: str) -> list[int]:
        if self.kv_manager is None:
            raise ConfigError("KVHandoffConnector: the scheduler never bound its KV cache manager")
        (ids,) = self.kv_manager.get_block_ids(rid)
        return list(ids)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
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
        return True, {
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

    def _bind_error(self, p: _PrefillReq) -> str | None:
        if p.bind is None:
            return "room not bound"
        try:
            p.bind.result(timeout=self.cfg.bind_timeout_s)
        except FutureTimeout:
            return (f"binding room {p.room} at the bootstrap server took more than "
                    f"{self.cfg.bind_timeout_s} s")
        except Exception as e:  # noqa: BLE001 - any failure means: no handoff, said why
            return (f"binding room {p.room} at the bootstrap server failed: "
                    f"{type(e).__name__}: {e}")
        return None

    def close(self) -> None:
        if self._binder is not None:
            self._binder.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


# ---------------------------------------------------------------------------- worker


@dataclass
class _Load:
    rid: str
    spec: RecvReq
    receiver: Any
    pages: list[int]  # vLLM block ids that were to be loaded (reported on failure)
    failed: str | None = None


class _WorkerSide:
    def __init__(self, cfg: _Config, vllm_config: VllmConfig,
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
        self._finished: set[str] = set()  # requests vLLM finished (senders may still run)
        self._loads: dict[str, _Load] = {}  # async loads
        self._sync: list[_Load] = []  # this step's layerwise loads
        self._errors: set[int] = set()

    def register(self, kv_caches: dict[str, Any]) -> None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        from kvhandoff.transfer import TransferAgent

        vc = self.vllm_config
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(f"kv_cache_groups: KVHandoffConnector supports one KV cache group, "
                              f"got {len(groups)} (run with --disable-hybrid-kv-cache-manager)")
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec):
            raise ConfigError(f"kv_cache_groups[0]: KVHandoffConnector moves full-attention "
                              f"(GQA) and MLA caches, got {type(spec).__name__}")
        mla = isinstance(spec, MLAAttentionSpec)
        mc = vc.model_config
        pc = vc.parallel_config
        tp_rank = _tp_rank()
        dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
        kv_dtype = f"{vc.cache_config.cache_dtype}:{dtype}"
        model = f"vllm:{getattr(mc.hf_config, 'model_type', '') or 'model'}"
        self.vl = build_layout(
            {n: t for n, t in kv_caches.items() if n in groups[0].layer_names},
            block_size=int(spec.block_size), kv_dtype=kv_dtype, model=model, mla=mla,
            total_kv_heads=1 if mla else int(mc.get_total_num_kv_heads()),
            tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size))
        kw: dict[str, Any] = dict(self.cfg.settings)
        if self.cfg.role == "prefill":
            kw["bootstrap_url"] = self.cfg.bootstrap_url
        settings = Settings(**kw)
        self.agent = TransferAgent(
            self.cfg.role, self.vl.layout, self.vl.buffers, settings,
            engine_id=self.cfg.engine_id, dp_rank=self.cfg.dp_rank, dp_size=self.cfg.dp_size,
            tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size))
        log.info("KVHandoffConnector %s: %s layout, %d layers, page %d tokens, agent %s",
                 self.cfg.role, self.vl.order, len(self.vl.layer_ids),
                 self.vl.layout.page_size_tokens, self.agent.address)

    # ---- per step

    def start_step(self, meta: KVHandoffMetadata) -> None:
        if self.agent is None:
            return
        vl = self.vl
        assert vl is not None
        self._step_senders = []
        for rid, reason in meta.resets.items():
            snd = self._senders.pop(rid, None)
            if snd is not None:  # not reported: the request runs on and sends again
                snd.abort(reason)
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
                sender = self.agent.sender(s.room, pages=vl.expand_blocks(s.block_ids),
                                           seq_len=s.num_tokens)
            except KVHandoffError as e:
                # no room: nothing will read the blocks; vLLM may free them once finished
                log.error("request %s (room %d): cannot open the sender: %s", rid, s.room, e)
                self._unsent.add(rid)
                continue
            self._senders[rid] = sender
            self._step_senders.append(sender)
        self._sync = []
        for rid, r in meta.recvs.items():
            ld = self._open_load(rid, r)
            if r.sync:
                self._sync.append(ld)
            else:
                self._loads[rid] = ld

    def _open_load(self, rid: str, r: RecvReq) -> _Load:
        vl = self.vl
        assert vl is not None
        bs = self.vllm_config.cache_config.block_size
        loaded = r.block_ids[r.local_tokens // bs: -(-r.load_tokens // bs)]
        try:
            receiver = self.agent.receiver(r.room, r.bootstrap_addr)
        except KVHandoffError as e:
            receiver = _NoRoom(r.room, f"cannot open the receiver: {e}")
        ld = _Load(rid=rid, spec=r, receiver=receiver, pages=list(loaded))
        if isinstance(receiver, _NoRoom):
            self._fail(ld, receiver.failure)
            return ld
        try:
            receiver.init(vl.expand_blocks(r.block_ids), r.num_tokens,
                          decode_prefix_len=r.local_tokens)
        except KVHandoffError as e:
            self._fail(ld, f"receiver init: {e}")
        return ld

    def _fail(self, ld: _Load, reason: str) -> None:
        if ld.failed is not None:
            return
        ld.failed = reason
        log.error("request %s (room %d): KV load failed, %d blocks reported: %s", ld.rid,
                  ld.spec.room, len(ld.pages), reason)
        ld.receiver.abort(reason)
        with self._lock:
            self._errors.update(ld.pages)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._sync or self.vl is None:
            return
        lid = self.vl.layer_ids.get(layer_name)
        if lid is None:
            return
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
        if lid is None:
            return
        if getattr(kv_layer, "is_cuda", False):
            self._ready_async(lid, kv_layer)
            return
        for s in self._step_senders:
            try:
                s.layer_ready(lid)
            except KVHandoffError as e:  # an aborted room: the forward goes on
                log.warning("room %d: layer_ready(%d): %s", s.room, lid, e)

    def _ready_async(self, lid: int, kv_layer: Any) -> None:
        """CUDA: record the layer's event on the current stream and hand it to layer_ready,
        which returns at once (the agent waits for the event on its own thread), so the
        forward never blocks on the copy engine."""
        import torch

        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(kv_layer.device))
        for s in self._step_senders:
            try:
                s.layer_ready(lid, ev)
            except KVHandoffError as e:  # an aborted room: the forward goes on
                log.warning("room %d: layer_ready(%d): %s", s.room, lid, e)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        self._sync = []
        self._step_senders = []
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
        for rid in self._unsent & self._finished:
            self._unsent.discard(rid)
            sent.add(rid)
        self._finished = {r for r in self._finished if r in self._senders or r in self._unsent}
        self._stale = [s for s in self._stale if not s.released]
        recvd: set[str] = set()
        for rid, ld in list(self._loads.items()):
            st = ld.receiver.poll()
            if st is KVPoll.Failed and ld.failed is None:
                self._fail(ld, ld.receiver.failure or "failed")
            if st in (KVPoll.Success, KVPoll.Failed) and ld.receiver.released:
                del self._loads[rid]
                recvd.add(rid)
        return (sent or None), (recvd or None)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


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


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0  # no initialised TP group (a single worker, tests)
