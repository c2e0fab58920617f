"""``KVHandoffKVManager`` / ``KVHandoffKVSender`` / ``KVHandoffKVReceiver`` on SGLang's
``Common*`` classes, backed by `kvhandoff.transfer.TransferAgent`.

Two planes, as in SGLang's own backends:

- **SGLang's control plane** (kept): the prefill ranks register with the bootstrap server
  (``PUT /route``); a decode rank looks them up (``GET /route``), then pushes its request
  metadata to the prefill rank's ZMQ PULL socket. Our metadata message (`Meta`, versioned
  msgpack) carries the room, ``decode_prefix_len``, the page count and the decode's status
  endpoint; the prefill answers failures it sees before any transfer exists with SGLang's status
  message (tag ``KVH_STATUS``, with the reason). Decode aborts use SGLang's ``AbortNotification``.
- **kvhandoff's data plane**: each rank runs two agents, one for the KV layout (main KV, draft
  KV, DSA indexer) and one for SGLang's metadata ("aux") buffers; prefill agents register with
  the kvhandoff bootstrap server under the engine ids `ENGINE_KV` / `ENGINE_AUX`, decode agents
  find them there (``/v1/route``) and open their rooms with the pages SGLang gives. Handshake
  with layout-hash check, per-layer checksums (one retransmit, then Failed), heartbeats and
  abort are the agent's.

What maps to what (see docs/SGLANG.md):

- SGLang sends only the suffix after ``decode_prefix_len`` (main KV and DSA indexer both: decode
  holds the prefix of both in its radix cache and gives destination pages for the suffix only).
  The agents see that suffix as the room's sequence: ``seq_len = pages * page_size`` (whole
  pages, as SGLang's backends copy them), ``decode_prefix_len = 0``; the k-th suffix page of
  prefill lands in the k-th suffix page of decode, region by region.
- Chunked prefill: the first ``send()`` opens the agent room with its chunk's pages
  (``sender(..., chunk_end=)``), each later one adds its pages (``Sender.add_chunk``); every
  chunk marks all layers ready at once, so each chunk moves as soon as SGLang reports it (per
  layer inside a chunk is out of reach: SGLang calls ``send()`` after the chunk's whole
  forward). The DSA indexer pages and the aux slot come with the last chunk only: the indexer
  (all of its suffix) and the aux room move then.
- ``poll()``: SGLang's state until the agent room exists, then the agent's (non-terminal ->
  ``Transferring``); a failure is recorded as SGLang's failure record, so ``failure_exception()``
  raises ``KVTransferError`` with kvhandoff's reason.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel
from sglang.srt.utils.network import NetworkAddress

from kvhandoff.errors import BootstrapNotFound, ConfigError, KVHandoffError
from kvhandoff.integrations.sglang.layout import Built, Parallel, build
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent

log = logging.getLogger("kvhandoff.sglang")

ENGINE_KV = "sglang-kvhandoff"
ENGINE_AUX = "sglang-kvhandoff-aux"
META_TAG = b"KVH_META"
REG_TAG = b"KVH_REG"
STATUS_TAG = b"KVH_STATUS"
WIRE_VERSION = 1
ROUTE_WAIT_S = 10.0


class Meta(msgspec.Struct, frozen=True):
    """Decode -> prefill: one decode rank's request for a room (SGLang's ZMQ control plane)."""

    v: int
    room: int
    decode_ip: str
    decode_port: int
    decode_prefix_len: int
    num_pages: int
    required_dst_info_num: int
    is_dummy: bool


class Hello(msgspec.Struct, frozen=True):
    """Decode -> prefill: a decode rank's registration (logged; nothing depends on it)."""

    v: int
    decode_ip: str
    decode_port: int
    engine_rank: int


_enc = msgspec.msgpack.Encoder()
_meta_dec = msgspec.msgpack.Decoder(Meta)
_hello_dec = msgspec.msgpack.Decoder(Hello)


@dataclass
class _DecodeInfo:
    """What ``CommonKVManager._room_notify_targets`` reads of ``transfer_infos`` entries."""

    endpoint: str
    dst_port: int
    is_dummy: bool
    required_dst_info_num: int
    decode_prefix_len: int
    num_pages: int


def _agent_settings(role: str, host: str, bootstrap_url: str | None) -> Settings:
    s = Settings()
    # SGLang lets a decode wait this long between its metadata and the prefill's last chunk
    # (the prefill's queueing and forward passes). The decode's agent room exists from the
    # metadata on, the prefill's only from the last chunk: until then the prefill agent keeps
    # the decode's request as an early message (bounded by bootstrap_timeout_s) and renews no
    # lease for it (lease_s). Both bounds are raised to SGLang's; a dead prefill is still found
    # within 2 heartbeats.
    wait = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
    upd: dict[str, Any] = {"agent_host": host,
                           "bootstrap_timeout_s": max(s.bootstrap_timeout_s, wait),
                           "lease_s": max(s.lease_s, wait)}
    if role == "prefill":
        upd["bootstrap_url"] = bootstrap_url
    return s.model_copy(update=upd)


def bootstrap_url_for(host: str, port: int) -> str:
    """The kvhandoff bootstrap server of this node: ``KVHANDOFF_BOOTSTRAP_URL`` (a sidecar) or
    the in-process server SGLang starts on ``--disaggregation-bootstrap-port``."""
    url = os.environ.get("KVHANDOFF_BOOTSTRAP_URL")
    if url:
        return url.rstrip("/")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class KVHandoffKVManager(CommonKVManager):  # type: ignore[misc]
    """One per SGLang scheduler rank: SGLang's control plane plus two kvhandoff agents."""

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: Any, is_mla_backend: bool | None = False) -> None:
        is_mla = bool(is_mla_backend)
        self._check_topology(is_mla)
        device = getattr(server_args, "device", None) or "cuda"
        built = build(args, is_mla=is_mla, device="cpu" if device == "cpu" else
                      f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}",
                      parallel=Parallel(attn_tp_size=get_parallel().attn_tp_size,
                                        pp_size=get_parallel().pp_size))
        self.built: Built = built
        self._stop = threading.Event()
        self._agents: list[TransferAgent] = []
        self._room_lock = threading.Lock()
        self._routes: dict[tuple[str, int, int], tuple[str, str | None]] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        host = self.bootstrap_host
        if self.dist_init_addr:  # multi-node: the server runs on the node of rank 0, as SGLang
            host = NetworkAddress.parse(self.dist_init_addr).resolved().host
        url = bootstrap_url_for(host, self.bootstrap_port)
        settings = _agent_settings(role, self.local_ip, url)
        ident = {"dp_rank": self.attn_dp_rank, "dp_size": self.attn_dp_size,
                 "tp_rank": self.attn_tp_rank, "tp_size": self.attn_tp_size}
        try:
            self.agent = TransferAgent(role, built.kv_layout, built.kv_buffers, settings,
                                       engine_id=ENGINE_KV, **ident)
            self._agents.append(self.agent)
            self.aux_agent: TransferAgent | None = None
            if built.aux_layout is not None:
                self.aux_agent = TransferAgent(role, built.aux_layout, built.aux_buffers,
                                               settings, engine_id=ENGINE_AUX, **ident)
                self._agents.append(self.aux_agent)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._control_loop, daemon=True,
                                        name=f"kvh-sglang-{role}-{self.attn_tp_rank}")
        self._thread.start()
        log.info("kvhandoff SGLang %s manager: agents %s, layout %s", role,
                 [a.address for a in self._agents], self.agent.layout_hash)

    @staticmethod
    def _check_topology(is_mla: bool) -> None:
        p, d = get_parallel(), get_disagg()
        problems = []
        if p.pp_size != 1:
            problems.append(f"pp_size={p.pp_size} (only 1)")
        if p.attn_cp_size != 1:
            problems.append(f"attn_cp_size={p.attn_cp_size} (only 1)")
        if p.enable_kv_cache_sharding:
            problems.append("--enable-kv-cache-sharding")
        if d.disaggregation_decode_allocation_policy != "early":
            problems.append("--disaggregation-decode-allocation-policy "
                            f"{d.disaggregation_decode_allocation_policy} (only 'early')")
        if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
            problems.append("SGLANG_DISAGG_STAGING_BUFFER (staging buffers)")
        if problems:
            raise ConfigError("kvhandoff SGLang backend does not support: " + "; ".join(problems))

    # ---------------------------------------------------------------- SGLang control plane

    def build_receiver_registration_message(self) -> list[bytes]:
        return [REG_TAG, _enc.encode(Hello(v=WIRE_VERSION, decode_ip=self.local_ip,
                                           decode_port=self.rank_port,
                                           engine_rank=int(self.kv_args.engine_rank)))]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: Any, aux_index: int | None,
                                        state_indices: list[Any] | None,
                                        decode_prefix_len: int | None, is_dummy: bool,
                                        device_kv_indices: Any = None) -> list[bytes]:
        return [META_TAG, _enc.encode(Meta(
            v=WIRE_VERSION, room=int(bootstrap_room), decode_ip=self.local_ip,
            decode_port=self.rank_port, decode_prefix_len=int(decode_prefix_len or 0),
            num_pages=len(kv_indices), required_dst_info_num=int(required_dst_info_num or 1),
            is_dummy=bool(is_dummy)))]

    def _control_loop(self) -> None:
        """Reads this rank's SGLang PULL socket: metadata/aborts (prefill), status (decode)."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                msg = self.server_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            try:
                self._on_message(msg)
            except Exception:  # one bad message must not stop the loop
                log.exception("kvhandoff SGLang manager: error handling a control message")

    def _on_message(self, msg: list[bytes]) -> None:
        if not msg:
            return
        tag = msg[0]
        if tag == META_TAG and len(msg) == 2:
            try:
                self._on_meta(_meta_dec.decode(msg[1]))
            except msgspec.DecodeError as e:
                log.warning("dropping a malformed kvhandoff metadata message: %s", e)
        elif tag == REG_TAG and len(msg) == 2:
            try:
                h = _hello_dec.decode(msg[1])
                log.debug("decode rank %s at %s:%s registered", h.engine_rank, h.decode_ip,
                          h.decode_port)
            except msgspec.DecodeError as e:
                log.warning("dropping a malformed kvhandoff registration: %s", e)
        elif tag == ABORT_TAG:
            note = AbortNotification.from_zmq(msg)
            if note is not None:
                self._on_decode_abort(note.room)
        elif tag == ABORT_ACK_TAG:
            self.handle_abort_ack_message(msg)
        elif tag == STATUS_TAG:
            parsed = self.parse_kv_status_message(msg)
            if parsed is not None and self.disaggregation_mode == DisaggregationMode.DECODE:
                room, status, rank, reason = parsed
                self.apply_prefill_status(bootstrap_room=room, status=status,
                                          prefill_rank=rank, failure_reason=reason)
        else:
            log.warning("dropping an unknown control message (tag %r)", tag[:16])

    def _on_meta(self, m: Meta) -> None:
        if m.v != WIRE_VERSION:
            log.warning("metadata of wire version %d for room %d (expected %d): dropped", m.v,
                        m.room, WIRE_VERSION)
            return
        with self._room_lock:
            infos = self.transfer_infos.setdefault(m.room, {})
            infos[(m.decode_ip, m.decode_port)] = _DecodeInfo(
                endpoint=m.decode_ip, dst_port=m.decode_port, is_dummy=m.is_dummy,
                required_dst_info_num=m.required_dst_info_num,
                decode_prefix_len=m.decode_prefix_len, num_pages=m.num_pages)
            if len(infos) < m.required_dst_info_num:
                return  # more decode ranks of this room still to come
            # every TP rank of the prefill must start its chunks at the same token, dummy
            # (MLA: decode TP < prefill TP) ones included: each gets the decode's prefix
            self.req_to_decode_prefix_len[m.room] = m.decode_prefix_len
        self.update_status(m.room, KVPoll.WaitingForInput)

    def _on_decode_abort(self, room: int) -> None:
        if room in self.request_status and self.request_status[room] != KVPoll.Success:
            self.record_failure(room, "Aborted by the decode (AbortReq)")
            self.update_status(room, KVPoll.Failed)
        # the decode's agents tell ours themselves (Abort), also for a room not opened yet

    def real_infos(self, room: int) -> list[_DecodeInfo]:
        with self._room_lock:
            return [i for i in self.transfer_infos.get(room, {}).values() if not i.is_dummy]

    # ---------------------------------------------------------------- decode: routes

    def route(self, bootstrap_addr: str, dp_rank: int, tp_rank: int, tp_size: int
              ) -> tuple[str, str | None]:
        """The control addresses of the prefill rank's KV and aux agents (cached)."""
        key = (bootstrap_addr, dp_rank, tp_rank)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        from kvhandoff.bootstrap_server.client import BootstrapClient

        url = bootstrap_addr if "://" in bootstrap_addr else f"http://{bootstrap_addr}"
        addrs: list[str | None] = []
        deadline = time.monotonic() + ROUTE_WAIT_S
        with BootstrapClient(url, total_wait_s=ROUTE_WAIT_S) as c:
            for engine in (ENGINE_KV, ENGINE_AUX if self.aux_agent is not None else None):
                if engine is None:
                    addrs.append(None)
                    continue
                while True:
                    try:
                        ranks = c.lookup_route(engine_id=engine, dp_rank=dp_rank,
                                               tp_rank=tp_rank, tp_size=tp_size)
                        break
                    except BootstrapNotFound:
                        # SGLang's registration is synchronous, the agents' is not: a prefill
                        # that just came up may not have registered its agents yet
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                if len(ranks) != 1:
                    raise KVHandoffError(f"route: expected one {engine} rank for dp {dp_rank} "
                                         f"tp {tp_rank}, got {len(ranks)}")
                addrs.append(ranks[0].agent_address)
        kv = addrs[0]
        assert kv is not None
        out = (kv, addrs[1])
        self._routes[key] = out
        return out

    def forget_routes(self, bootstrap_addr: str) -> None:
        """Drops the cached agent addresses of a prefill (after a failure: it may have
        restarted with new ones)."""
        for k in [k for k in self._routes if k[0] == bootstrap_addr]:
            self._routes.pop(k, None)

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stops the control thread and closes the agents (their open rooms fail)."""
        self._stop.set()
        t = getattr(self, "_thread", None)
        if t is not None:
            t.join(timeout=5)
        for a in self._agents:
            a.close()
        self._agents = []
        sock = getattr(self, "server_socket", None)
        if sock is not None and not sock.closed:
            sock.close(0)

    supports_role_switch = False

    def teardown(self) -> None:
        self.close()


def _merge(handles: list[Any]) -> tuple[KVPoll | int, str | None]:
    """SGLang state of the agent rooms of one request: Failed (with a reason) if any failed,
    Success if all succeeded, else Transferring."""
    states = [h.poll() for h in handles]
    for h, st in zip(handles, states, strict=True):
        if int(st) == int(KVPoll.Failed):
            return KVPoll.Failed, h.failure or "kvhandoff transfer failed"
    if all(int(st) == int(KVPoll.Success) for st in states):
        return KVPoll.Success, None
    return KVPoll.Transferring, None


def _release(handles: list[Any], reason: str) -> None:
    """SGLang forgets the request: an agent room still open is aborted (its pages freed)."""
    for h in handles:
        if int(h.poll()) not in (int(KVPoll.Success), int(KVPoll.Failed)):
            h.abort(reason)


class KVHandoffKVSender(CommonKVSender):  # type: ignore[misc]
    """Prefill side of one request."""

    kv_mgr: KVHandoffKVManager
    _transfer_start_time: float | None

    def __init__(self, mgr: KVHandoffKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._chunks: list[np.ndarray] = []
        self._handles: list[Any] = []
        self._kv: Any = None  # the KV agent room's sender, once the first chunk opened it
        self._streamed = 0  # pages of `_chunks` the KV agent room has
        self._opened = False  # the last chunk came
        # SGLang's event behind the chunk's KV writes: the agent waits for it on its own
        # thread before reading the pages (layer_ready(layer, event)); the scheduler never
        # blocks on it
        self._event: Any = None

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, indices_event: Any = None) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or self._opened:
            return
        kv_indices, _slice, is_last, skip = self._prepare_send_indices(kv_indices,
                                                                        state_indices)
        if skip:
            return
        self._event = indices_event
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
                table: dict[str, Any] = dict.fromkeys(b.kv_regions, new)
                if b.dsa_slot is not None:
                    table["indexer"] = np.zeros(0, np.int64)  # with the last chunk
                self._kv = mgr.agent.sender(self.bootstrap_room, pages=table,
                                            seq_len=min(total) * ps, chunk_end=len(pages) * ps,
                                            num_decode_ranks=len(real))
                self._handles.append(self._kv)
            else:
                self._kv.add_chunk(dict.fromkeys(b.kv_regions, new), len(pages) * ps)
            self._streamed = len(pages)
            for layer in sorted({lid for r in b.kv_layout.regions for lid in r.layer_ids}):
                self._kv.layer_ready(layer, self._event)
        except KVHandoffError as e:
            self._fail(f"kvhandoff: {e}")

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
        try:
            if len(pages):
                table: dict[str, Any] = dict.fromkeys(b.kv_regions, pages)
                if b.dsa_slot is not None:
                    dsa = None if state_indices is None else state_indices[b.dsa_slot]
                    if dsa is None or len(dsa) != len(pages):
                        raise ConfigError(
                            f"state_indices[{b.dsa_slot}] (DSA indexer): expected the "
                            f"{len(pages)} suffix pages, got "
                            f"{None if dsa is None else len(dsa)}")
                    table["indexer"] = np.asarray(dsa, dtype=np.int64).reshape(-1)
                ps = b.kv_layout.page_size_tokens
                if self._kv is None:
                    h = mgr.agent.sender(room, pages=table, seq_len=len(pages) * ps,
                                         num_decode_ranks=len(real))
                    self._handles.append(h)
                else:
                    h = self._kv
                    for name in b.kv_regions:
                        table[name] = pages[self._streamed:]
                    h.add_chunk(table, len(pages) * ps)
                for layer in sorted({lid for r in b.kv_layout.regions for lid in r.layer_ids}):
                    h.layer_ready(layer, self._event)
            if mgr.aux_agent is not None:
                if self.aux_index is None:
                    raise ConfigError("aux_index: the last chunk came without SGLang's "
                                      "metadata buffer index")
                assert b.aux_layout is not None
                ah = mgr.aux_agent.sender(
                    room, pages={r.name: [int(self.aux_index)] for r in b.aux_layout.regions},
                    seq_len=1, num_decode_ranks=len(real))
                self._handles.append(ah)
                for r in b.aux_layout.regions:
                    ah.layer_ready(r.layer_ids[0], self._event)
        except KVHandoffError as e:
            self._fail(f"kvhandoff: {e}")

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
        st, reason = _merge(self._handles)
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

    def clear(self) -> None:
        _release(self._handles, "sender cleared before the transfer ended")
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


class KVHandoffKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """Decode side of one request."""

    kv_mgr: KVHandoffKVManager

    def __init__(self, mgr: KVHandoffKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._handles: list[Any] = []
        self._agent_addrs: tuple[str, str | None] | None = None

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed:
            return
        try:
            self._agent_addrs = self.kv_mgr.route(
                self.bootstrap_addr, int(prefill_dp_rank), int(self.target_tp_rank),
                int(self.prefill_info.attn_tp_size))
        except KVHandoffError as e:
            self._local_failure(f"kvhandoff route lookup at {self.bootstrap_addr} failed: {e}")

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
        if prefix % ps:
            problem = (f"decode_prefix_len: {prefix} is not a multiple of page_size={ps} "
                       f"(SGLang sends whole suffix pages)")
        elif b.dsa_slot is not None and len(pages):
            dsa = None if state_indices is None else state_indices[b.dsa_slot]
            if dsa is None or len(dsa) != len(pages):
                problem = (f"state_indices[{b.dsa_slot}] (DSA indexer): expected the "
                           f"{len(pages)} suffix pages, got {None if dsa is None else len(dsa)}")
            else:
                table["indexer"] = np.asarray(dsa, dtype=np.int64).reshape(-1)
        if problem is None and mgr.aux_agent is not None and aux_index is None:
            problem = "aux_index: missing (SGLang's metadata buffer slot)"
        if problem is not None:
            self._local_failure(f"kvhandoff: {problem}")
            return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
        if self.conclude_state == KVPoll.Failed or self._agent_addrs is None:
            return
        kv_addr, aux_addr = self._agent_addrs
        room = self.bootstrap_room
        assert room is not None
        try:
            if len(pages):
                h = mgr.agent.receiver(room, peer=kv_addr)
                self._handles.append(h)
                h.init(table, len(pages) * ps, 0)
            if mgr.aux_agent is not None and aux_addr is not None:
                assert b.aux_layout is not None
                ah = mgr.aux_agent.receiver(room, peer=aux_addr)
                self._handles.append(ah)
                ah.init({r.name: [int(aux_index or 0)] for r in b.aux_layout.regions}, 1, 0)
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
        st, reason = _merge(self._handles)
        if st == KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, reason or "failed")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            for h in self._handles:
                h.abort(reason or "failed")
            # the prefill's agents may be gone (restart: new addresses); look them up again
            self.kv_mgr.forget_routes(self.bootstrap_addr)
        elif st == KVPoll.Success:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        else:
            return KVPoll.Transferring
        return super().poll()

    def clear(self) -> None:
        _release(self._handles, "receiver cleared before the transfer ended")
        super().clear()

    def abort(self) -> None:
        super().abort()
        for h in self._handles:
            h.abort("Aborted by AbortReq on the decode")
