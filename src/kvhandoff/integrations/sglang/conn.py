"""kvhandoff as an SGLang disaggregation backend: ``KVHandoffKVManager`` (here, with what its
sender and receiver share), ``KVHandoffKVSender`` (`sender`) and ``KVHandoffKVReceiver``
(`receiver`) on SGLang's ``Common*`` classes, backed by `kvhandoff.transfer.TransferAgent`.

Two planes, as in SGLang's own backends:

- **SGLang's control plane** (kept): the prefill ranks register with the bootstrap server
  (``PUT /route``); a decode rank looks them up (``GET /route``), then pushes its request
  metadata to the prefill rank's ZMQ PULL socket. Our metadata message (`Meta`, versioned
  msgpack) carries the room, ``decode_prefix_len``, the page count and the decode's status
  endpoint; the prefill answers failures it sees before any transfer exists with SGLang's status
  message (tag ``KVH_STATUS``, with the reason). Decode aborts use SGLang's ``AbortNotification``.
- **kvhandoff's data plane**: each rank runs one agent for the KV layout (main KV, draft KV,
  DSA indexer, draft indexer, the sliding-window pool), one for SGLang's metadata ("aux")
  buffers, with ``index_kpool`` compression one for the DSA kpool tail, and for Mamba / linear
  attention (and QSA) models one for the state rows; prefill agents register with the kvhandoff
  bootstrap server under the engine ids `ENGINE_KV` / `ENGINE_AUX` / `ENGINE_TAIL` /
  `ENGINE_STATE`,
  decode agents find them there (``/v1/route``) and open their rooms with the pages SGLang
  gives. Handshake with layout-hash check, per-layer checksums (one retransmit, then Failed),
  heartbeats and abort are the agent's.

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
- The kpool tail (``StateType.DSA_TAIL``): SGLang's 6-tuple per request names the live ring
  slots (``seq_len % index_kpool`` tokens); they are the tail room's pages (`layout.tail_pages`),
  so a tail moves slot by slot into the decode's ring. No live tail: no tail room on either
  side; the decode states its live tail length in its metadata and a prefill that counts
  another fails the room naming both.
- Decode allocation policy ``early`` only (SGLang's own argument checks allow
  ``prefill_complete`` with Mooncake only; the manager refuses it too).
- Decode pages of a failed or aborted request: SGLang holds them (deferred release) until
  `KVHandoffKVManager.is_abort_release_safe` says every agent room of the request is released.
- A prefill that stops answering ``/health`` is forgotten by SGLang's heartbeat checker (started
  on decode), routes included, so a restarted prefill is looked up again.
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
import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVManager,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel
from sglang.srt.utils.network import NetworkAddress

from kvhandoff.errors import BootstrapNotFound, ConfigError, KVHandoffError
from kvhandoff.integrations.lanes import buffers_memory, choose_lane
from kvhandoff.integrations.sglang.layout import (
    Built,
    Parallel,
    build,
    hetero_tp_refusal,
    tail_pages,
)
from kvhandoff.netaddr import bare_host, url_for
from kvhandoff.settings import Settings
from kvhandoff.transfer import TransferAgent

log = logging.getLogger("kvhandoff.sglang")

ENGINE_KV = "sglang-kvhandoff"
ENGINE_AUX = "sglang-kvhandoff-aux"
ENGINE_TAIL = "sglang-kvhandoff-tail"
ENGINE_STATE = "sglang-kvhandoff-state"
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
    tail_tokens: int = 0  # live DSA kpool tail tokens of the decode's request (0: none)
    attn_tp_size: int = 0  # the decode's attention TP size (0: not stated)
    swa_pages: int = 0  # pages of the decode's SWA state indices (its window; 0: none)


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
class DecodeInfo:
    """What ``CommonKVManager._room_notify_targets`` reads of ``transfer_infos`` entries."""

    endpoint: str
    dst_port: int
    is_dummy: bool
    required_dst_info_num: int
    decode_prefix_len: int
    num_pages: int
    tail_tokens: int = 0
    swa_pages: int = 0
    attn_tp_size: int = 0  # the decode's attention TP size (0: not stated)


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


def dp_group_of(mgr: Any) -> tuple[int, int]:
    """The DP group a rank's agents register under, and how many there are: the key SGLang's
    bootstrap server files a prefill rank under (``dp_group``) and a decode looks it up by
    (``prefill_dp_rank``): the attention-DP rank, or with system DP (``--dp-size`` > 1 without
    DP attention, where every replica's attention-DP rank is 0) the replica's
    ``system_dp_rank``."""
    if int(getattr(mgr, "system_dp_size", 1) or 1) > 1:
        return int(mgr.system_dp_rank or 0), int(mgr.system_dp_size)
    return int(mgr.attn_dp_rank), int(mgr.attn_dp_size)


def agent_lane(settings: Settings, buffers: Any, name: str, role: str) -> tuple[Settings, str]:
    """The settings one agent of a rank starts with for `buffers` (`integrations.lanes`: CUDA
    memory takes shm's CUDA IPC lane on this host and nixl to other hosts), logged; raises
    `ConfigError` naming the setting (or the install line) when nothing configured moves them."""
    memory = buffers_memory(buffers, f"SGLang {name} buffers")
    try:
        out, line = choose_lane(settings, memory)
    except ConfigError as e:
        raise ConfigError(f"kvhandoff SGLang {role} backend, {name} agent: {e}") from e
    log.info("kvhandoff SGLang %s backend, %s agent: %s", role, name, line)
    return out, line


def bootstrap_url_for(host: str, port: int) -> str:
    """The kvhandoff bootstrap server of this node: ``KVHANDOFF_BOOTSTRAP_URL`` (a sidecar) or
    the in-process server SGLang starts on ``--disaggregation-bootstrap-port``."""
    url = os.environ.get("KVHANDOFF_BOOTSTRAP_URL")
    if url:
        return url.rstrip("/")
    host = bare_host(host)
    return url_for({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), port)


class KVHandoffKVManager(CommonKVManager):  # type: ignore[misc]
    """One per SGLang scheduler rank: SGLang's control plane plus its kvhandoff agents (KV, aux,
    and the DSA tail and the Mamba state where the model has them)."""

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: Any, is_mla_backend: bool | None = False) -> None:
        is_mla = bool(is_mla_backend)
        self._check_topology(is_mla, args, server_args)
        device = getattr(server_args, "device", None) or "cuda"
        built = build(args, is_mla=is_mla, device="cpu" if device == "cpu" else
                      f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}",
                      parallel=Parallel(attn_tp_size=get_parallel().attn_tp_size,
                                        pp_size=get_parallel().pp_size,
                                        attn_tp_rank=get_parallel().attn_tp_rank))
        self.built: Built = built
        self._stop = threading.Event()
        self._agents: list[TransferAgent] = []
        self._room_lock = threading.Lock()
        self._routes: dict[tuple[str, int, int],
                           tuple[str, str | None, str | None, str | None]] = {}
        # decode: the agent rooms of each request, until SGLang forgets it (deferred release)
        self.room_handles: dict[int, list[Any]] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        host = self.bootstrap_host
        if self.dist_init_addr:  # multi-node: the server runs on the node of rank 0, as SGLang
            host = NetworkAddress.parse(self.dist_init_addr).resolved().host
        url = bootstrap_url_for(host, self.bootstrap_port)
        settings = _agent_settings(role, self.local_ip, url)
        hold_s = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
        if role == "decode" and self.enable_deferred_decode_kv_release \
                and hold_s < settings.write_quarantine_s:
            log.warning("kvhandoff SGLang decode: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_"
                        "RELEASE_TIMEOUT=%ss is shorter than KVHANDOFF_WRITE_QUARANTINE_S=%ss: "
                        "SGLang may free the pages of a request whose lost prefill could still "
                        "write into them; raise the former", hold_s,
                        settings.write_quarantine_s)
        self.probe_report = self._probe(args, settings, device)
        self.dp_group, self.dp_groups = dp_group_of(self)
        ident = {"dp_rank": self.dp_group, "dp_size": self.dp_groups,
                 "tp_rank": self.attn_tp_rank, "tp_size": self.attn_tp_size}
        # each agent's lane from where its buffers live (the KV pool, the DSA tail and the
        # Mamba state on the GPU, SGLang's metadata buffers in host memory): refused here,
        # naming the setting or the install line, when the transport cannot move them
        # (inside the try: a refusal closes SGLang's zmq context of this manager too)
        try:
            parts = [("kv", built.kv_buffers), ("aux", built.aux_buffers),
                     ("tail", built.tail_buffers)]
            if built.state_layout is not None:  # a Mamba / linear-attention model's state rows
                parts.append(("state", built.state_buffers))
            lanes = {name: agent_lane(settings, bufs, name, role) for name, bufs in parts}
            self.lanes = {name: line for name, (_, line) in lanes.items()}
            self.agent = TransferAgent(role, built.kv_layout, built.kv_buffers, lanes["kv"][0],
                                       engine_id=ENGINE_KV, **ident)
            self._agents.append(self.agent)
            self.aux_agent: TransferAgent | None = None
            if built.aux_layout is not None:
                self.aux_agent = TransferAgent(role, built.aux_layout, built.aux_buffers,
                                               lanes["aux"][0], engine_id=ENGINE_AUX, **ident)
                self._agents.append(self.aux_agent)
            self.tail_agent: TransferAgent | None = None
            if built.tail_layout is not None:
                self.tail_agent = TransferAgent(role, built.tail_layout, built.tail_buffers,
                                                lanes["tail"][0], engine_id=ENGINE_TAIL,
                                                **ident)
                self._agents.append(self.tail_agent)
            self.state_agent: TransferAgent | None = None
            if built.state_layout is not None:
                self.state_agent = TransferAgent(role, built.state_layout, built.state_buffers,
                                                 lanes["state"][0], engine_id=ENGINE_STATE,
                                                 **ident)
                self._agents.append(self.state_agent)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._control_loop, daemon=True,
                                        name=f"kvh-sglang-{role}-{self.attn_tp_rank}")
        self._thread.start()
        # decode: SGLang's heartbeat checker (GET /health of every prefill it knows, as its
        # other backends start it): a prefill that stops answering is forgotten, cached
        # connection info and agent routes alike (`_handle_node_failure`), so the next request
        # looks it up again and finds it where it restarted
        self._heartbeat: threading.Thread | None = None
        if role == "decode":
            self._heartbeat = self._start_heartbeat_checker_thread()
        log.info("kvhandoff SGLang %s manager: agents %s, layout %s", role,
                 [a.address for a in self._agents], self.agent.layout_hash)

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        """SGLang's registration of this prefill rank (``PUT /route``, from its
        ``register_to_bootstrap``), made with this process's KVHANDOFF_AUTH_TOKEN (SGLang's own
        sends none, which a token-protected server refuses). Retried while the server is not
        up; a refusal or a server that never answers stops the start with the reason (SGLang's
        own logs an error and serves a prefill no decode can find)."""
        from kvhandoff.integrations.sglang.bootstrap import write

        write("PUT", url, payload, what="this prefill rank's registration (PUT /route)")

    def _probe(self, args: KVArgs, settings: Settings, device: str) -> str:
        """The layout probe (`probe.verify`) on a scratch pool of the live pool's class; its
        report (logged), or `LayoutProbeError` (refuse to start)."""
        if not settings.layout_probe:
            report = ("layout probe off (layout_probe=false): the SGLang pool layout is not "
                      "checked against its write kernels")
            log.warning("kvhandoff SGLang manager: %s", report)
            return report
        if not self.built.kv_layout.region(self.built.kv_regions[0]).num_live_layers:
            return "layout probe: no live main-KV layer"
        from kvhandoff.integrations.sglang.probe import verify

        dev = "cpu" if device == "cpu" else f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}"
        out = verify(args, self.built, dev)
        (log.info if out.verified else log.warning)("kvhandoff SGLang manager: %s", out.report)
        return out.report

    @staticmethod
    def _check_topology(is_mla: bool, args: Any = None, server_args: Any = None) -> None:
        p, d = get_parallel(), get_disagg()
        problems = []
        if p.pp_size != 1:
            problems.append(f"pp_size={p.pp_size} (only 1: the layout pairs whole layer sets, "
                            "not a pipeline stage's share)")
        if p.attn_cp_size != 1:
            problems.append(f"attn_cp_size={p.attn_cp_size} (only 1: context-parallel ranks "
                            "hold token shares of a page the span builder does not pair)")
        if getattr(p, "attn_dcp_size", 1) != 1:
            problems.append(f"attn_dcp_size={p.attn_dcp_size} (only 1: decode context "
                            "parallelism splits the latent and replicates the indexer per rank)")
        if p.enable_kv_cache_sharding:
            problems.append("--enable-kv-cache-sharding")
        if d.disaggregation_decode_allocation_policy != "early":
            problems.append("--disaggregation-decode-allocation-policy "
                            f"{d.disaggregation_decode_allocation_policy} (only 'early': "
                            "SGLang's own argument checks allow 'prefill_complete' with the "
                            "Mooncake backend only)")
        if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
            problems.append("SGLANG_DISAGG_STAGING_BUFFER (staging buffers)")
        if envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() == "INTRA_NODE_NVLINK":
            problems.append("SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK (it puts "
                            "SGLang's metadata buffers in CUDA memory; this backend moves them "
                            "as host memory)")
        if getattr(server_args, "enable_hisparse", False):
            problems.append("--enable-hisparse (the decode's KV destination is then "
                            "HiSparse's host pool, which this backend does not address)")
        ib = getattr(args, "ib_device", None)
        if ib:
            problems.append(f"--disaggregation-ib-device {ib} (this backend does not choose "
                            "RDMA devices from SGLang's setting; unset it and select them in "
                            "the transport's own settings, e.g. UCX_NET_DEVICES for UCX)")
        if problems:
            raise ConfigError("kvhandoff SGLang backend does not support: " + "; ".join(problems))

    # ---------------------------------------------------------------- deferred release

    # SGLang holds the pages of a decode request that failed or was aborted mid-transfer
    # until `is_abort_release_safe` says no write into them can still land (or its
    # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT passed), instead of freeing them
    # at once.
    supports_deferred_decode_kv_release = True

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether SGLang may free the decode pages of `bootstrap_room`: every agent room of
        the request on this rank is *released* (terminal, and the agents know no write into
        its pages can land any more: a one-sided prefill confirmed its writes stopped, or
        ``write_quarantine_s`` passed). A request that opened no agent room has nothing that
        could write. SGLang's count of prefill acknowledgements (`required_acks`) is not
        used: this backend's prefill ranks send none, the decode's agents know."""
        handles = self.room_handles.get(int(bootstrap_room))
        return handles is None or all(h.released for h in handles)

    def forget_released_rooms(self) -> None:
        """Drops the requests whose agent rooms are all released (safe to free whatever
        SGLang still holds of them: `is_abort_release_safe` says True without them)."""
        for room, handles in list(self.room_handles.items()):
            if all(h.released for h in handles):
                self.room_handles.pop(room, None)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self.room_handles.pop(int(bootstrap_room), None)

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
            is_dummy=bool(is_dummy), tail_tokens=self._tail_tokens(state_indices),
            attn_tp_size=int(self.attn_tp_size),
            swa_pages=self._state_len(self.built.swa_slot, state_indices)))]

    @staticmethod
    def _state_len(slot: int | None, state_indices: list[Any] | None) -> int:
        if slot is None or state_indices is None or slot >= len(state_indices) \
                or state_indices[slot] is None:
            return 0
        return len(state_indices[slot])

    def tp_refusal(self, prefill_attn_tp: int, decode_attn_tp: int) -> str | None:
        """Why this pair cannot hand off a non-MLA pool (None: it can). Such a pool holds a
        rank's share of the KV heads: between TP sizes each decode rank takes its heads from
        the prefill ranks that hold them (`layout.hetero_tp_refusal` says which pairs can; the
        prefill, which SGLang tells the model's KV head count, also checks they divide)."""
        if self.is_mla_backend or not prefill_attn_tp or not decode_attn_tp:
            return None
        heads = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        return hetero_tp_refusal(self.built, int(prefill_attn_tp), int(decode_attn_tp), heads)

    def sends_aux(self, decode_attn_tp: int) -> bool:
        """Whether this prefill rank sends the request's metadata (aux) buffers: a decode rank
        of a non-MLA pool that gathers its heads from several prefill ranks (prefill TP >
        decode TP) takes them from the first of those ranks only."""
        p = int(self.attn_tp_size)
        if self.is_mla_backend or not decode_attn_tp or p <= decode_attn_tp:
            return True
        return int(self.attn_tp_rank) % (p // int(decode_attn_tp)) == 0

    def _tail_tokens(self, state_indices: list[Any] | None) -> int:
        slot = self.built.tail_slot
        if slot is None or state_indices is None or slot >= len(state_indices):
            return 0
        return len(tail_pages(state_indices[slot], f"state_indices[{slot}] (dsa_tail)"))

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
        refused = self.tp_refusal(int(self.attn_tp_size), m.attn_tp_size)
        if refused is not None:
            self.update_status(m.room, KVPoll.WaitingForInput)  # opens it if it is new
            self.record_failure(m.room, refused)
            self.update_status(m.room, KVPoll.Failed)
            self.send_kv_status_message(targets=[(m.decode_ip, m.decode_port)],
                                        bootstrap_room=m.room, status=KVPoll.Failed,
                                        failure_reason=refused)
            return
        with self._room_lock:
            infos = self.transfer_infos.setdefault(m.room, {})
            infos[(m.decode_ip, m.decode_port)] = DecodeInfo(
                endpoint=m.decode_ip, dst_port=m.decode_port, is_dummy=m.is_dummy,
                required_dst_info_num=m.required_dst_info_num,
                decode_prefix_len=m.decode_prefix_len, num_pages=m.num_pages,
                tail_tokens=m.tail_tokens, swa_pages=m.swa_pages,
                attn_tp_size=m.attn_tp_size)
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

    def real_infos(self, room: int) -> list[DecodeInfo]:
        with self._room_lock:
            return [i for i in self.transfer_infos.get(room, {}).values() if not i.is_dummy]

    # ---------------------------------------------------------------- decode: routes

    def route(self, bootstrap_addr: str, dp_rank: int, tp_rank: int, tp_size: int
              ) -> tuple[str, str | None, str | None, str | None]:
        """The control addresses of the prefill rank's KV, aux, tail and state agents
        (cached)."""
        key = (bootstrap_addr, dp_rank, tp_rank)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        from kvhandoff.bootstrap_server.client import BootstrapClient

        url = bootstrap_addr if "://" in bootstrap_addr else f"http://{bootstrap_addr}"
        addrs: list[str | None] = []
        deadline = time.monotonic() + ROUTE_WAIT_S
        with BootstrapClient(url, total_wait_s=ROUTE_WAIT_S) as c:
            for engine in (ENGINE_KV, ENGINE_AUX if self.aux_agent is not None else None,
                           ENGINE_TAIL if self.tail_agent is not None else None,
                           ENGINE_STATE if self.state_agent is not None else None):
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
        out = (kv, addrs[1], addrs[2], addrs[3])
        self._routes[key] = out
        return out

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        super()._handle_node_failure(failed_bootstrap_addr)
        self.forget_routes(failed_bootstrap_addr)

    def forget_routes(self, bootstrap_addr: str) -> None:
        """Drops the cached agent addresses of a prefill (after a failure: it may have
        restarted with new ones)."""
        for k in [k for k in list(self._routes) if k[0] == bootstrap_addr]:
            self._routes.pop(k, None)

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stops the control thread (and the decode's heartbeat checker), closes the agents
        (their open rooms fail), then SGLang's zmq context of this manager with every socket it
        made (the rank socket, the cached PUSH sockets to the other side's ranks and their
        monitors). Left to the garbage
        collector, that context's finaliser terminates it while those sockets are still open
        (their weak references are cleared first) and blocks whichever thread collected it,
        for good: seen in the test suite as a 2 s test taking 120 s."""
        self._stop.set()
        beat = getattr(self, "_heartbeat_shutdown", None)
        if beat is not None:
            beat.set()
        for t in (getattr(self, "_thread", None), getattr(self, "_heartbeat", None)):
            if t is not None:
                t.join(timeout=5)
        for a in self._agents:
            a.close()
        self._agents = []
        sock = getattr(self, "server_socket", None)
        if sock is not None and not sock.closed:
            sock.close(0)
        ctx = getattr(self, "_zmq_ctx", None)
        if ctx is not None and not ctx.closed:
            ctx.destroy(linger=0)

    supports_role_switch = False

    def teardown(self) -> None:
        self.close()


def merge_states(handles: list[Any]) -> tuple[KVPoll | int, str | None]:
    """SGLang state of the agent rooms of one request: Failed (with a reason) if any failed,
    Success if all succeeded, else Transferring."""
    states = [h.poll() for h in handles]
    for h, st in zip(handles, states, strict=True):
        if int(st) == int(KVPoll.Failed):
            return KVPoll.Failed, h.failure or "kvhandoff transfer failed"
    if all(int(st) == int(KVPoll.Success) for st in states):
        return KVPoll.Success, None
    return KVPoll.Transferring, None


def release_open(handles: list[Any], reason: str) -> None:
    """SGLang forgets the request: an agent room still open is aborted (its pages freed)."""
    for h in handles:
        if int(h.poll()) not in (int(KVPoll.Success), int(KVPoll.Failed)):
            h.abort(reason)
