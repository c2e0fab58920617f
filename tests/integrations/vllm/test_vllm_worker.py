"""Worker side of KVHandoffConnector in two processes over CPU tensors: a prefill worker process
(`vllm_worker_proc.py`) and the decode worker in this process, each with vLLM's own planner and
allocator (per-layer ``[B, H, N, C]`` views; the prefill BLHNC: every layer's page packed into
one block, the decode LBHNC: one region per layer), a real bootstrap server on 127.0.0.1 port 0
and the tcp transport.

The prefill writes each layer's KV and calls ``save_kv_layer`` per layer; the decode waits per
layer (``wait_for_layer_load``, layerwise mode) or polls ``get_finished`` (async mode). Room A of
each mode must land byte-exact in the decode's (shuffled) blocks beyond its local prefix, with
the prefix block untouched; room B is aborted by the prefill before any layer goes out, and the
decode must report exactly B's blocks through ``get_block_ids_with_load_errors``. The prefill
reports every room in ``finished_sending`` (vLLM frees the blocks then).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.connector import RecvReq  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

SEQ = 40  # 3 blocks of 16, the last one holds 8 tokens
LOCAL = 16  # room A: the decode holds one block of the prompt already (a prefix-cache hit)
START_S = 120.0  # the prefill process imports vLLM and torch on a loaded 2-core machine
DONE_S = 60.0
MARK = 0xAB
PROC = Path(__file__).with_name("vllm_worker_proc.py")
# the prefill packs every layer's page into one block (BLHNC, one row buffer), the decode keeps
# one buffer per layer (LBHNC): the handshake ignores packing, the spans pair them
PREFILL_LAYOUT, DECODE_LAYOUT = "BLHNC", "LBHNC"


class Child:
    """A worker process of these tests (`proc`, default the prefill worker) speaking JSON
    lines."""

    def __init__(self, cfg: dict[str, Any], proc: Path = PROC) -> None:
        self.p = subprocess.Popen([sys.executable, str(proc), json.dumps(cfg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.q.put(line)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None and self.q.empty():
                raise AssertionError(f"prefill process: no {event!r} (exit {self.p.poll()})")
            try:
                line = self.q.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line.startswith("{"):
                msg: dict[str, Any] = json.loads(line)
                if msg.get("event") == event:
                    return msg

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


def rooms() -> dict[str, dict[str, Any]]:
    """Per request: prefill blocks, decode blocks (shuffled, other ids), local prefix."""
    return {
        "A1": {"src": [5, 6, 7], "dst": [9, 4, 12], "local": LOCAL},
        "B1": {"src": [10, 11, 12], "dst": [20, 21, 22], "local": 0},
        "A2": {"src": [15, 16, 17], "dst": [30, 25, 27], "local": LOCAL},
        "B2": {"src": [20, 21, 22], "dst": [40, 41, 42], "local": 0},
    }


def loaded_blocks(r: dict[str, Any], sync: bool) -> set[int]:
    bs = env.BLOCK_SIZE
    load = SEQ - (1 if sync else 0)
    return set(r["dst"][r["local"] // bs: -(-load // bs)])


@pytest.mark.timeout(300)  # the prefill process imports vLLM: ~20 s alone, minutes on a loaded box
def test_two_process_per_layer_handoff_and_load_errors(bootstrap: str,
                                                       tmp_path: Path) -> None:
    mdir = env.model_dir(tmp_path)
    rs = rooms()
    room = {rid: room_of(env.ENGINE_P, rid) for rid in rs}
    send = [{"rid": rid, "room": room[rid], "blocks": rs[rid]["src"], "seq": SEQ}
            for rid in rs]
    child = Child({"bootstrap_url": bootstrap, "model_dir": str(mdir), "transport": "tcp",
                   "layout": PREFILL_LAYOUT,
                   "steps": [{"sends": [s for s in send if s["rid"].startswith("A")]},
                             # B's last chunk is scheduled, but the request is aborted before
                             # its forward wrote a layer (vLLM: request_finished -> aborts)
                             {"sends": [s for s in send if s["rid"].startswith("B")],
                              "forward": False},
                             {"sends": [], "aborts": ["B1", "B2"]}]})
    try:
        cfg = env.vllm_config(mdir, role="kv_consumer", engine_id=env.ENGINE_D,
                              layout=DECODE_LAYOUT,
                              extra={"settings": {"transport": "tcp",
                                                  "heartbeat_interval_s": 1.0},
                                     "layer_timeout_s": DONE_S})
        kcc = env.kv_cache_config(cfg)
        views = env.allocate(cfg, kcc)
        conn = KVHandoffConnector(cfg, KVConnectorRole.WORKER, kcc)
        conn.register_kv_caches(views)
        for v in views.values():
            env.as_u8(v).fill_(MARK)
        assert child.expect("registered", START_S)["ok"]
        with BootstrapClient(bootstrap) as c:  # what the prefill scheduler does per request
            for rid in rs:
                c.bind_room(room[rid], env.ENGINE_P, 0)
        host, port = split_addr(bootstrap)

        def recv(rid: str, sync: bool) -> RecvReq:
            r = rs[rid]
            return RecvReq(room=room[rid], bootstrap_addr=f"{host}:{port}",
                           block_ids=r["dst"], num_tokens=SEQ, local_tokens=r["local"],
                           load_tokens=SEQ - (1 if sync else 0), sync=sync)

        # layerwise: waited on inside the step's forward, layer by layer
        conn.bind_connector_metadata(KVHandoffMetadata(recvs={
            "A1": recv("A1", True), "B1": recv("B1", True)}))
        for name in env.layer_names():
            conn.wait_for_layer_load(name)
        errors_sync = conn.get_block_ids_with_load_errors()
        assert conn.get_finished(set()) == (None, None)  # sync loads are not async receives
        conn.clear_connector_metadata()

        # async: the loads run between steps; the requests come back through get_finished
        conn.bind_connector_metadata(KVHandoffMetadata(recvs={
            "A2": recv("A2", False), "B2": recv("B2", False)}))
        conn.clear_connector_metadata()
        recvd: set[str] = set()
        errors_async: set[int] = set()
        deadline = time.monotonic() + DONE_S
        while recvd != {"A2", "B2"} and time.monotonic() < deadline:
            _, got = conn.get_finished(set())
            recvd |= got or set()
            errors_async |= conn.get_block_ids_with_load_errors()
            time.sleep(0.02)  # one engine step
        assert recvd == {"A2", "B2"}

        # exactly the blocks of the failed rooms that were to be loaded
        assert errors_sync == loaded_blocks(rs["B1"], True) == {20, 21, 22}
        assert errors_async == loaded_blocks(rs["B2"], False) == {40, 41, 42}

        # byte-exact where the rooms landed, the local prefix block untouched
        for layer, name in enumerate(env.layer_names()):
            u = env.as_u8(views[name])
            shape = tuple(u.shape[1:])
            for rid in ("A1", "A2"):
                dst = rs[rid]["dst"]
                assert bool((u[dst[0]] == MARK).all()), f"{rid} prefix block overwritten"
                for j in (1, 2):
                    n = min(env.BLOCK_SIZE, SEQ - j * env.BLOCK_SIZE)
                    want = env.block_pattern(layer, j, shape)[:, :n]
                    assert torch.equal(u[dst[j], :, :n], want), (rid, layer, j)
        fin = child.expect("finished", DONE_S)
        assert fin["rids"] == sorted(rs)  # every room ended; vLLM may free the blocks
        conn.shutdown()
    finally:
        child.close()
