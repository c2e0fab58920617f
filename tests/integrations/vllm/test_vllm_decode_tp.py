"""Prefill and decode of other TP sizes through the connector's worker side (TP 1 -> 2 and
2 -> 1): a prefill request that says its decode's TP size (``kv_transfer_params.decode_tp_size``,
carried in the `SendReq`) has its room opened for that many readers; one that says nothing
(vLLM's own proxy) has it opened without a count, and each decode rank's transfer request tells
the prefill rank how many decode ranks read it. Each decode rank takes its KV heads, byte-exact,
and each prefill rank reports the request in ``finished_sending`` once its readers are done.

Before, a room without the hint was opened for the prefill's own TP size: TP 1 -> 2 took one
reader, the second was refused (or the decode, seeing the size differ, computed the prompt
itself and the room held its blocks until its deadline).

All in this process: three KVHandoffConnectors (a TP 1 prefill, decode ranks 0 and 1 of TP 2,
each with its own agent and vLLM-allocated CPU KV from vLLM's own planner: two KV heads on the
prefill, one per decode rank), the tcp transport, a real bootstrap server on 127.0.0.1 port 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402

import kvhandoff.integrations.vllm.worker as worker_side  # noqa: E402
from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.config import DeclineReq  # noqa: E402
from kvhandoff.integrations.vllm.connector import RecvReq, SendReq  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

try:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

SEQ = 40  # three 16-token blocks, the last one partial
DONE_S = 60.0
SETTINGS = {"transport": "tcp", "heartbeat_interval_s": 1.0}


@pytest.fixture
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


def worker(mdir: Path, role: str, extra: dict[str, Any], *, tp_rank: int, tp_size: int,
           monkeypatch: pytest.MonkeyPatch) -> tuple[KVHandoffConnector, dict[str, torch.Tensor]]:
    """A worker of TP rank `tp_rank` of `tp_size`: vLLM's plan for its share of the heads."""
    engine = env.ENGINE_P if role == "kv_producer" else env.ENGINE_D
    cfg = env.vllm_config(mdir, role=role, engine_id=engine,
                          extra={**extra, "settings": SETTINGS})
    cfg.parallel_config.tensor_parallel_size = tp_size
    spec = FullAttentionSpec(block_size=env.BLOCK_SIZE, num_kv_heads=env.NUM_KV_HEADS // tp_size,
                             head_size=env.HEAD_SIZE, dtype=torch.bfloat16)
    kcc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(env.layer_names(), spec)],
                                          env.NUM_BLOCKS * spec.page_size_bytes * env.NUM_LAYERS)
    views = env.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    # the rank vLLM's TP group would give this worker (no process group in one process)
    monkeypatch.setattr(worker_side, "_tp_rank", lambda: tp_rank)
    conn.register_kv_caches(views)
    return conn, views


@pytest.mark.parametrize(("p_tp", "d_tp", "hint"), [
    (1, 2, 2),  # the proxy says the decode's TP size
    (1, 2, None),  # vLLM's own proxy: nothing said, each decode rank tells the prefill
    (2, 1, None),
])
def test_prefill_ranks_serve_every_decode_rank(bootstrap: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, p_tp: int,
                                               d_tp: int, hint: int | None) -> None:
    """Prefill TP `p_tp` into decode TP `d_tp`; `hint`: the SendReq's decode TP size (None: the
    room is opened without a reader count, which the decode ranks' requests then give). Each
    decode rank lands its KV heads byte-exact from the prefill ranks holding them; every
    prefill rank reports the request in ``finished_sending`` once its readers are done."""
    mdir = env.model_dir(tmp_path)
    pres = [worker(mdir, "kv_producer", {"bootstrap_url": bootstrap}, tp_rank=r, tp_size=p_tp,
                   monkeypatch=monkeypatch) for r in range(p_tp)]
    decs = [worker(mdir, "kv_consumer", {"layer_timeout_s": DONE_S}, tp_rank=r, tp_size=d_tp,
                   monkeypatch=monkeypatch) for r in range(d_tp)]
    heads_p, heads_d = env.NUM_KV_HEADS // p_tp, env.NUM_KV_HEADS // d_tp
    try:
        for pre, _ in pres:
            assert pre.agent.wait_registered(DONE_S)
        room = room_of(env.ENGINE_P, "p1")
        with BootstrapClient(bootstrap) as c:
            c.bind_room(room, env.ENGINE_P, 0)
        src = [1, 2, 3]
        for pre, pviews in pres:
            pre.bind_connector_metadata(KVHandoffMetadata(sends={
                "p1": SendReq(room=room, block_ids=src, num_tokens=SEQ, decode_tp_size=hint)}))
            for layer, name in enumerate(env.layer_names()):  # the forward: write, save
                u = env.as_u8(pviews[name])
                for j, b in enumerate(src):
                    u[b] = env.block_pattern(layer, j, tuple(u.shape[1:]))
                pre.save_kv_layer(name, pviews[name], None)
            assert pre.get_finished({"p1"}) == (None, None)  # nobody has read it yet
            pre.clear_connector_metadata()

        host, port = split_addr(bootstrap)
        dst = [11, 5, 13]
        for dec, _ in decs:
            dec.bind_connector_metadata(KVHandoffMetadata(recvs={"d1": RecvReq(
                room=room, bootstrap_addr=f"{host}:{port}", block_ids=dst, num_tokens=SEQ,
                local_tokens=0, load_tokens=SEQ - 1, sync=True, prefill_tp_size=p_tp)}))
        for name in env.layer_names():
            for dec, _ in decs:
                dec.wait_for_layer_load(name)
        for dec, _ in decs:
            assert dec.get_block_ids_with_load_errors() == set()
            dec.clear_connector_metadata()

        for r, (_, dviews) in enumerate(decs):  # decode rank r holds heads_d heads from r on
            for h in range(heads_d):
                head = r * heads_d + h
                _, pviews = pres[head // heads_p]
                for layer, name in enumerate(env.layer_names()):
                    got, want = env.as_u8(dviews[name]), env.as_u8(pviews[name])
                    for j, (b, a) in enumerate(zip(dst, src, strict=True)):
                        n = min(env.BLOCK_SIZE, SEQ - 1 - j * env.BLOCK_SIZE)
                        assert torch.equal(got[b, h, :n], want[a, head % heads_p, :n]), (
                            r, head, layer, j)

        for pre, _ in pres:  # released once its readers are done
            assert env.finished_sending(pre, DONE_S) == {"p1"}
    finally:
        for pre, _ in pres:
            pre.shutdown()
        for dec, _ in decs:
            dec.shutdown()


def test_declined_room_is_aborted_at_the_prefill(bootstrap: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode that does not load a remote prefill (here: its scheduler found the prompt in
    its prefix cache) aborts the room: the prefill's room fails with the decode's reason and the
    request is reported in ``finished_sending`` (its blocks go back to vLLM). Before, nothing
    told the prefill, and its room held the blocks until its deadline."""
    mdir = env.model_dir(tmp_path)
    pre, pviews = worker(mdir, "kv_producer", {"bootstrap_url": bootstrap}, tp_rank=0,
                         tp_size=1, monkeypatch=monkeypatch)
    decs = [worker(mdir, "kv_consumer", {}, tp_rank=r, tp_size=2, monkeypatch=monkeypatch)
            for r in range(2)]
    try:
        assert pre.agent.wait_registered(DONE_S)
        room = room_of(env.ENGINE_P, "p2")
        with BootstrapClient(bootstrap) as c:
            c.bind_room(room, env.ENGINE_P, 0)
        pre.bind_connector_metadata(KVHandoffMetadata(sends={
            "p2": SendReq(room=room, block_ids=[1, 2, 3], num_tokens=SEQ)}))
        for name in env.layer_names():
            pre.save_kv_layer(name, pviews[name], None)
        sender = pre._worker._senders["p2"]  # type: ignore[union-attr]
        assert pre.get_finished({"p2"}) == (None, None)  # vLLM finished it; nobody read it
        pre.clear_connector_metadata()
        host, port = split_addr(bootstrap)
        reason = "the decode holds the prompt in its prefix cache"
        for dec, _ in decs:
            dec.bind_connector_metadata(KVHandoffMetadata(declines={"d2": DeclineReq(
                room=room, bootstrap_addr=f"{host}:{port}", prefill_tp_size=1,
                reason=reason)}))
            dec.clear_connector_metadata()
        assert env.finished_sending(pre, DONE_S) == {"p2"}
        assert reason in (sender.failure or ""), sender.failure
    finally:
        pre.shutdown()
        for dec, _ in decs:
            dec.shutdown()
