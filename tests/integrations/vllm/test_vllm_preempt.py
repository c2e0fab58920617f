"""A preempted prefill request: its sender is aborted and dropped without being reported (vLLM
freed its blocks and runs the request again), the room reopens at the request's next last
chunk on new blocks, and that second sender is the one the decode reads, byte-exact, and the
one reported in ``finished_sending``.

Both workers live in this process (two KVHandoffConnectors, each with its own agent, vLLM
allocated CPU KV, the tcp transport, a real bootstrap server on 127.0.0.1 port 0); the
two-process case is `test_vllm_worker.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.connector import RecvReq, SendReq  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

SEQ = 40
DONE_S = 60.0


@pytest.fixture
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


def worker(mdir: Path, role: str, extra: dict[str, object]) -> tuple[KVHandoffConnector,
                                                                     dict[str, torch.Tensor]]:
    cfg = env.vllm_config(mdir, role=role,
                          engine_id=env.ENGINE_P if role == "kv_producer" else env.ENGINE_D,
                          extra={**extra, "settings": {"transport": "tcp",
                                                       "heartbeat_interval_s": 1.0}})
    kcc = env.kv_cache_config(cfg)
    views = env.allocate(cfg, kcc)
    conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(views)
    return conn, views


def forward(conn: KVHandoffConnector, views: dict[str, torch.Tensor], blocks: list[int],
            salt: int) -> None:
    """One prefill forward: per layer, write the KV of `blocks` and save the layer."""
    for layer, name in enumerate(env.layer_names()):
        u = env.as_u8(views[name])
        for j, b in enumerate(blocks):
            u[b] = env.block_pattern(layer + salt, j, tuple(u.shape[1:]))
        conn.save_kv_layer(name, views[name], None)


def test_preempted_prefill_resends_from_its_new_blocks(bootstrap: str, tmp_path: Path) -> None:
    mdir = env.model_dir(tmp_path)
    pre, pviews = worker(mdir, "kv_producer", {"bootstrap_url": bootstrap})
    dec, dviews = worker(mdir, "kv_consumer", {"layer_timeout_s": DONE_S})
    try:
        assert pre.agent.wait_registered(DONE_S)
        room = room_of(env.ENGINE_P, "p1")
        with BootstrapClient(bootstrap) as c:
            c.bind_room(room, env.ENGINE_P, 0)

        # step 1: the last chunk on blocks 1..3, the forward writes stale KV (salt 100)
        pre.bind_connector_metadata(KVHandoffMetadata(sends={
            "p1": SendReq(room=room, block_ids=[1, 2, 3], num_tokens=SEQ)}))
        forward(pre, pviews, [1, 2, 3], salt=100)
        assert pre.get_finished(set()) == (None, None)
        pre.clear_connector_metadata()
        # step 2: preempted (blocks freed), recomputed later on blocks 7..9
        pre.bind_connector_metadata(KVHandoffMetadata(resets={"p1": "preempted"}))
        pre.clear_connector_metadata()
        pre.bind_connector_metadata(KVHandoffMetadata(sends={
            "p1": SendReq(room=room, block_ids=[7, 8, 9], num_tokens=SEQ)}))
        forward(pre, pviews, [7, 8, 9], salt=0)
        sent, _ = pre.get_finished({"p1"})  # finished on the scheduler: one token asked
        assert not sent  # the decode has not read it yet
        pre.clear_connector_metadata()

        host, port = split_addr(bootstrap)
        dec.bind_connector_metadata(KVHandoffMetadata(recvs={"d1": RecvReq(
            room=room, bootstrap_addr=f"{host}:{port}", block_ids=[11, 5, 13], num_tokens=SEQ,
            local_tokens=0, load_tokens=SEQ - 1, sync=True)}))
        for name in env.layer_names():
            dec.wait_for_layer_load(name)
        assert dec.get_block_ids_with_load_errors() == set()
        dec.clear_connector_metadata()

        for layer, name in enumerate(env.layer_names()):
            u = env.as_u8(dviews[name])
            shape = tuple(u.shape[1:])
            for j, b in enumerate([11, 5, 13]):
                n = min(env.BLOCK_SIZE, SEQ - j * env.BLOCK_SIZE)
                want = env.block_pattern(layer, j, shape)[:, :n]
                assert torch.equal(u[b, :, :n], want), (layer, j)

        assert env.finished_sending(pre, DONE_S) == {"p1"}
        assert pre.get_finished(set()) == (None, None)  # reported once
    finally:
        pre.shutdown()
        dec.shutdown()


def test_a_room_that_cannot_open_is_reported_not_leaked(bootstrap: str, tmp_path: Path) -> None:
    """Two requests naming one room (a duplicate request id at the proxy): the second room
    cannot open. The prefill reports that request in finished_sending once vLLM finished it
    (its blocks are free to go, nothing reads them); the decode reports exactly its blocks as
    load errors and the request in finished_recving. The forward goes on."""
    mdir = env.model_dir(tmp_path)
    pre, pviews = worker(mdir, "kv_producer", {"bootstrap_url": bootstrap})
    dec, _ = worker(mdir, "kv_consumer", {"load_mode": "async"})
    try:
        room = room_of(env.ENGINE_P, "dup")
        pre.bind_connector_metadata(KVHandoffMetadata(sends={
            "x": SendReq(room=room, block_ids=[1, 2, 3], num_tokens=SEQ),
            "y": SendReq(room=room, block_ids=[4, 5, 6], num_tokens=SEQ)}))
        forward(pre, pviews, [1, 2, 3], salt=0)
        assert pre.get_finished(set()) == (None, None)  # y is not finished on the scheduler
        assert pre.get_finished({"y"}) == ({"y"}, None)
        pre.clear_connector_metadata()

        host, port = split_addr(bootstrap)
        addr = f"{host}:{port}"
        dec.bind_connector_metadata(KVHandoffMetadata(recvs={
            "d1": RecvReq(room=room, bootstrap_addr=addr, block_ids=[11, 12, 13],
                          num_tokens=SEQ, local_tokens=0, load_tokens=SEQ, sync=False),
            "d2": RecvReq(room=room, bootstrap_addr=addr, block_ids=[21, 22, 23],
                          num_tokens=SEQ, local_tokens=16, load_tokens=SEQ, sync=False)}))
        dec.clear_connector_metadata()
        _, recvd = dec.get_finished(set())
        assert recvd == {"d2"}
        assert dec.get_block_ids_with_load_errors() == {22, 23}  # beyond its local block
    finally:
        pre.shutdown()
        dec.shutdown()
