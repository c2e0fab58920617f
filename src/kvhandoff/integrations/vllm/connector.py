"""`KVHandoffConnector`: kvhandoff as a vLLM v1 KV connector (vLLM 0.33).

Pick it with::

    --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
        "kv_connector_module_path": "kvhandoff.integrations.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_url": "http://127.0.0.1:8998"}}'

What maps to what (docs/VLLM.md has the whole flow):

- a prefill request (``do_remote_decode``) is a room: ``room_of(engine_id, request_id)``, bound
  to this engine's dp rank at the bootstrap server when the request gets its blocks; each rank
  opens it without a reader count (each decode rank's request says how many read that prefill
  rank), or, where the request gives the decode's TP size, for those readers (`params`);
- its block ids are the page table; at the step that schedules its last prompt chunk the
  workers open a `Sender`; each attention layer's ``save_kv_layer`` is that layer's
  ``layer_ready`` (the layer goes out while the next ones compute); ``wait_for_save`` readies
  the layers no ``save_kv_layer`` reported (vLLM's DSA attention calls none, a full CUDA graph
  skips it: `worker`);
- ``request_finished`` keeps the blocks (returns True) and hands the decode the params it needs;
  the workers report the request in ``finished_sending`` once the room is terminal and its pages
  released (Success, or Failed after the decode gave up), and only then does vLLM free them;
- a decode request (``do_remote_prefill``) announces the prompt tokens beyond its local prefix
  hit in ``get_num_new_matched_tokens``; ``update_state_after_alloc`` records its blocks; the
  workers open a `Receiver` (``decode_prefix_len`` = the local hit, so only the suffix moves);
  a remote prefill the decode declines (bad params, its whole prompt cached) is aborted at the
  prefill, which frees the blocks at once;
- a decode request vLLM queues (no slot yet) is held at its prefill ranks until it is
  allocated or ends, so its room outlives the prefill's ``bootstrap_timeout_s`` (`holds`);
- ``load_mode = "async"`` (default): the load runs between steps and the request comes back
  through ``finished_recving``, so a slow prefill holds only its own request;
  ``"layerwise"``: a synchronous load: each attention layer's ``wait_for_layer_load`` is that
  layer's ``wait_for_layer`` (per-layer streaming into the step that computes the last prompt
  token; a DSA layout's is waited for whole in ``start_load_kv``); only this mode asks vLLM for
  piecewise CUDA graphs;
- a failed load (any typed kvhandoff failure: peer lost, checksum, layout, timeout ...) reports
  exactly the request's loaded blocks through ``get_block_ids_with_load_errors``, so vLLM's
  ``kv_load_failure_policy`` (``fail`` / ``recompute``) applies;
- hybrid models: the connector is ``SupportsHMA`` (vLLM keeps its hybrid allocator on and calls
  ``request_finished_all_groups``); a model whose every layer has one sliding window moves only
  the pages in the window (`scheduler`); a model of several groups (full-attention beside
  sliding-window layers) moves every group in one room, each sliding-window group from its
  window on; a model with Mamba / linear-attention state moves each state group's block that
  holds the request's state as its own region, the prefill computing the prompt but its last
  token, which the decode computes (`groups`);
- ``register_kv_caches`` reads vLLM's KV cache group (`groups`: one group of full-attention,
  sliding-window or MLA layers, or of a DSA model's MLA + indexer layers), takes the attention
  backend from vLLM's own layers (one backend of the `backends` table, else refused), builds
  the layout that backend's kernels write, and runs the
  layout probe (`probe`) on scratch pages before the agent starts: "layout verified against
  <backend>" in the log, or a refusal to start naming backend, slot and plane;
- ``get_kv_connector_stats`` hands vLLM each step's ended rooms (`stats`): they show in vLLM's
  ``/metrics`` as ``vllm:kvhandoff_*`` and in its "KV Transfer metrics" log line.

vLLM builds the connector once per process with one role, so this class only dispatches: the
scheduler process's state and decisions are `scheduler.SchedulerSide`, each worker's are
`worker.WorkerSide`, and what the two share (the extra config, the per-step metadata) is
`config`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.config import (
    DEFAULT_LOAD_MODE,
    LOAD_MODES,
    ConnectorConfig,
    KVHandoffMetadata,
    RecvReq,
    SendReq,
    log_through_vllm,
)
from kvhandoff.integrations.vllm.groups import plan_group, truncate_for_state
from kvhandoff.integrations.vllm.layout import VllmLayout
from kvhandoff.integrations.vllm.scheduler import SchedulerSide
from kvhandoff.integrations.vllm.stats import KVHandoffPromMetrics, KVHandoffStats
from kvhandoff.integrations.vllm.worker import WorkerSide
from kvhandoff.runtime.tracing import enable_marks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


log = logging.getLogger("kvhandoff.vllm")

__all__ = ["LOAD_MODES", "KVHandoffConnector", "KVHandoffMetadata", "RecvReq", "SendReq"]


class KVHandoffConnector(KVConnectorBase_V1, SupportsHMA):
    """kvhandoff's vLLM v1 KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()
        self._cfg = ConnectorConfig.of(vllm_config)
        if self._cfg.timeline:
            enable_marks()
        # what cannot be moved (several groups, SSM state ...) is refused here, in the
        # scheduler process too, before the engine serves a request
        mc = vllm_config.model_config
        plan = plan_group(kv_cache_config, model=str(mc.model) if mc is not None else "")
        if plan.group_regions and self._cfg.role == "decode" and \
                self._cfg.load_mode == "layerwise":
            raise ConfigError(
                f"kv_connector_extra_config.load_mode='layerwise': this model has "
                f"{len(plan.group_regions)} KV cache groups (vLLM's hybrid allocator); vLLM "
                "takes a failed load of such a model by request only while the request waits "
                "for its KV (async), so a failed layerwise load could not be reported: use "
                "load_mode 'async' (the default)")
        self._states = bool(plan.states)
        self._hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self._cfg, vllm_config,
                                        sliding_window=plan.sliding_window,
                                        group_block_size=plan.block_size,
                                        group_windows=plan.group_windows,
                                        group_extra=plan.group_extra, states=plan.states)
        else:
            self._worker = WorkerSide(self._cfg, vllm_config, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # head-major pages (LBHNC): a KV head is a plane of its own, so a decode of another TP
        # size takes its heads from the prefill ranks that hold them (token-major pages are
        # refused across TP sizes at the handshake); MLA's one latent row per token is the
        # same either way, so vLLM's default stands
        mc = vllm_config.model_config
        if mc is None or mc.use_mla:
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # only a layerwise decode needs its per-layer hook (wait_for_layer_load) inside the
        # forward; a prefill hands over at wait_for_save what save_kv_layer did not report (a
        # full CUDA graph skips it), an async decode loads between steps
        return bool(extra_config.get("load_mode", DEFAULT_LOAD_MODE) == "layerwise")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # the agent registered the KV caches' memory at start; sleep mode frees and remaps it
        return False

    # ---- scheduler side

    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """A prefill request of a model with state: its prompt cut before the last token
        (`groups.truncate_for_state`); one that cannot be cut is computed here, not handed
        off (said in the log). Decode: the scheduler notes a request vLLM may queue (its
        rooms are held at the prefill while it waits, `holds`)."""
        self._s().on_new_request(request)
        params = request.kv_transfer_params
        if (not self._states or self._cfg.role != "prefill" or not params
                or not params.get("do_remote_decode") or params.get("kvhandoff_state_cut")):
            return
        if not truncate_for_state(request, self._hash_block_size):
            params["do_remote_decode"] = False
            log.warning("request %s: not handed off (computed here): its prompt (%d tokens%s) "
                        "cannot stop before its last token, which the decode of a model with "
                        "Mamba state computes", request.request_id, request.num_prompt_tokens,
                        ", given as embeddings" if request.prompt_token_ids is None else "")

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group vLLM transfers: a room writes the request's own blocks of each. (vLLM's
        default, the prefix-cacheable groups, leaves out a Mamba state group, whose newly
        allocated state block vLLM would then zero after the load wrote it.)"""
        return tuple(self._kv_cache_config.transfer_group_ids)

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

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: vLLM keeps its hybrid allocator on (a sliding-window group frees the
        # blocks out of the window); the workers' senders hold every group's table already,
        # group 0's ids go in the params (for the record: the decode reads none of them)
        return self._s().request_finished(request, list(block_ids[0]) if block_ids else [])

    # ---- worker side

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVHandoffMetadata)
        self._w().start_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # rooms open in bind_connector_metadata; a DSA layout's layerwise load is waited here
        self._w().start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._w().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        # sends are asynchronous (vLLM keeps the blocks until finished_sending); a DSA
        # layout's layers no save_kv_layer reported go out now (vLLM's DSA attention reports
        # none)
        self._w().finish_forward()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.32+: a failed load of a model with several KV cache groups is reported by
        # request (vLLM takes no block-level errors there: its block ids are per group); it
        # is in finished_recving too, as vLLM expects
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        sent, recvd = self.get_finished(finished_req_ids)
        done = set(recvd or ())
        return KVConnectorTransferResults(finished_sending=set(sent or ()),
                                          finished_recving=done,
                                          failed_recving=self._w().take_failed_loads(done))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    def get_kv_connector_stats(self) -> KVHandoffStats | None:
        # the room legs that ended on this worker since the last step (stats.py)
        return self._worker.stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVHandoffStats:
        return KVHandoffStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVHandoffPromMetrics:
        return KVHandoffPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

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

    @property
    def probe_report(self) -> str | None:
        """What the layout probe found at start ("layout verified against ...", or why it did
        not run); None before `register_kv_caches`."""
        return self._worker.probe_report if self._worker is not None else None

    def vllm_layers(self) -> dict[str, Any]:
        """vLLM's attention layer objects of this worker's KV cache group, by layer name."""
        return self._w().layers()
