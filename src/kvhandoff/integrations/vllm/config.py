"""What a `KVHandoffConnector` is configured with and what its scheduler hands its workers each
step: the connector's extra config (`ConnectorConfig`), the per-step metadata (`SendReq`,
`RecvReq`, `KVHandoffMetadata`) and where kvhandoff's log lines go inside an engine process."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.vllm.params import (
    split_addr,
)
from kvhandoff.settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvhandoff.vllm")

LOAD_MODES = ("layerwise", "async")
DEFAULT_LOAD_MODE = "async"
_EXTRA_KEYS = {"bootstrap_url", "load_mode", "layer_timeout_s", "bind_timeout_s", "settings",
               "attention_backend", "decode_tp_size", "timeline"}


@dataclass
class SendReq:
    """Open a sender: the request's whole page table (vLLM block ids) and prompt length."""

    room: int
    block_ids: list[int]
    num_tokens: int
    # the decode's TP size, where the request or the settings give it (the readers per prefill
    # rank follow); None: each decode rank tells the prefill how many read it
    decode_tp_size: int | None = None
    # leading blocks a sliding window dropped (vLLM's null block): never read, since the
    # decode's load starts after them (`scheduler`)
    dropped_blocks: int = 0
    # several KV cache groups (vLLM's hybrid allocator): every group's table and its dropped
    # blocks, in group order (`block_ids`, `dropped_blocks`: group 0's); empty: one group
    group_blocks: list[list[int]] = field(default_factory=list)
    group_dropped: list[int] = field(default_factory=list)


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
    prefill_tp_size: int = 1  # the prefill's TP size (kv_transfer_params.tp_size)
    refuse: str | None = None  # why this load fails at once (the room is aborted)
    # several KV cache groups: every group's table (`block_ids`: group 0's) and the token its
    # load starts at (`local_tokens` for a full-attention group, later for a sliding window
    # whose earlier blocks vLLM never allocated); empty: one group
    group_blocks: list[list[int]] = field(default_factory=list)
    group_starts: list[int] = field(default_factory=list)

    def loaded_blocks(self, block_size: int) -> list[int]:
        """The vLLM block ids this load writes (every group's, from its start)."""
        end = -(-self.load_tokens // block_size)
        if not self.group_blocks:
            return self.block_ids[self.local_tokens // block_size:end]
        return [b for ids, start in zip(self.group_blocks, self.group_starts, strict=True)
                for b in ids[start // block_size:end]]


@dataclass
class DeclineReq:
    """A remote prefill this decode does not load (it computes the prompt itself): its room
    is aborted at the prefill ranks, which free the request's blocks at once."""

    room: int
    bootstrap_addr: str
    prefill_tp_size: int
    reason: str


@dataclass
class HoldReq:
    """A remote prefill whose decode request vLLM has queued (no slot yet): each worker holds
    its room at the prefill ranks it will read it from (`holds`) until its receiver opens or
    the request ends."""

    room: int
    bootstrap_addr: str


@dataclass
class KVHandoffMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    sends: dict[str, SendReq] = field(default_factory=dict)
    recvs: dict[str, RecvReq] = field(default_factory=dict)
    aborts: dict[str, str] = field(default_factory=dict)  # finished request id -> reason
    # preempted prefills: their blocks were freed, the room restarts at the next last chunk
    resets: dict[str, str] = field(default_factory=dict)
    declines: dict[str, DeclineReq] = field(default_factory=dict)
    # queued decode requests: held from this step on, and those no longer held (admitted,
    # declined or ended); changes only, the workers keep the set (`holds`)
    holds: dict[str, HoldReq] = field(default_factory=dict)
    unholds: list[str] = field(default_factory=list)
    # no token scheduled in this step: the engine only polls (a decode whose requests all wait
    # for their KV), so the workers may wait a moment for a load instead of returning at once
    idle: bool = False


@dataclass
class ConnectorConfig:
    role: str  # "prefill" | "decode"
    engine_id: str
    dp_rank: int
    dp_size: int
    bootstrap_url: str | None
    load_mode: str
    layer_timeout_s: float
    bind_timeout_s: float
    settings: dict[str, Any]
    # the backend's name where vLLM's layers cannot tell (no attention layers registered: tools
    # and tests driving the worker side without a model); must agree with the layers if any
    attention_backend: str | None = None
    # prefill: the decode TP size of a request that does not say (None: the readers say)
    decode_tp_size: int | None = None
    # a timestamped log line at each step of a handoff (`runtime.tracing.mark`; make bench-live)
    timeline: bool = False

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> ConnectorConfig:
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
        mode = extra.get("load_mode", DEFAULT_LOAD_MODE)
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
        backend = extra.get("attention_backend")
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise ConfigError(f"kv_connector_extra_config.attention_backend: expected a vLLM "
                              f"backend name (e.g. CPU_ATTN), got {backend!r}")
        dtp = extra.get("decode_tp_size")
        if dtp is not None and (isinstance(dtp, bool) or not isinstance(dtp, int) or dtp < 1):
            raise ConfigError(f"kv_connector_extra_config.decode_tp_size: expected the decode "
                              f"engines' TP size (an integer >= 1), got {dtp!r}")
        timeline = extra.get("timeline", False)
        if not isinstance(timeline, bool):
            raise ConfigError(f"kv_connector_extra_config.timeline: expected true or false, got "
                              f"{timeline!r}")
        pc = vllm_config.parallel_config
        if int(pc.pipeline_parallel_size) > 1:
            raise ConfigError(f"parallel_config.pipeline_parallel_size="
                              f"{pc.pipeline_parallel_size}: KVHandoffConnector hands over the "
                              "KV of every layer from one TP group; run pipeline parallel size "
                              "1 (--pipeline-parallel-size 1) on both sides")
        return cls(attention_backend=backend, role=role, engine_id=str(kt.engine_id),
                   decode_tp_size=dtp, timeline=timeline,
                   dp_rank=int(pc.data_parallel_rank),
                   dp_size=int(pc.data_parallel_size), bootstrap_url=url, load_mode=mode,
                   layer_timeout_s=_pos(extra, "layer_timeout_s", 30.0),
                   bind_timeout_s=_pos(extra, "bind_timeout_s", 5.0), settings=settings)


def log_through_vllm() -> None:
    """kvhandoff's loggers write through vLLM's handler (its format and level) when nothing
    else configured them: in a `vllm serve` process the root logger has no handler, so the
    connector's INFO lines ("layout verified against ...") would otherwise be lost."""
    ours = logging.getLogger("kvhandoff")
    vllm_log = logging.getLogger("vllm")
    root = logging.getLogger()
    # a root handler at WARNING (a library's implicit ``logging.basicConfig``, seen in a
    # Qwen3-Next engine's worker) would drop the INFO lines all the same
    configured = root.handlers and root.getEffectiveLevel() <= logging.INFO
    if ours.handlers or configured or not vllm_log.handlers:
        return
    for h in vllm_log.handlers:
        ours.addHandler(h)
    ours.setLevel(vllm_log.level or logging.INFO)
    ours.propagate = False


def _pos(extra: dict[str, Any], key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key}: expected a number > 0, got {v!r}")
    return float(v)


# ---------------------------------------------------------------------------- connector
