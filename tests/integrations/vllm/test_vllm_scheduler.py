"""The real vLLM 0.33 `Scheduler` with KVHandoffConnector loaded by `kv_connector_module_path`,
a tiny local model config and a real bootstrap server on 127.0.0.1 port 0: one prefill request
and one decode request driven through `schedule()` / `update_from_output()`.

Checks the calls the connector gets and what it answers: the room is bound at the bootstrap
server, the prefill's page table is the request's block ids, `request_finished` delays the free
until the workers report `finished_sending` and returns the params the decode needs; the decode
announces the remote tokens, records its destination blocks (layerwise: the last prompt token is
computed in the loading step; async: the load runs between steps), and a reported load error on
its blocks is handled by vLLM's `kv_load_failure_policy` (recompute / fail).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402  (this folder is on sys.path: pytest rootdir import)
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.params import room_of, split_addr  # noqa: E402
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402

PROMPT = 40  # 3 blocks of 16, the last one partial


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        with BootstrapClient(url) as c:
            # the prefill engine's worker would register itself (its agent); here only the
            # scheduler runs, so the test registers its rank
            layout = LayoutSpec(page_size_tokens=16, kv_dtype="bf16", regions=(
                RegionSpec("kv", (0,), (Plane("kv", 64),)),))
            c.register_rank(engine_id=env.ENGINE_P, role="prefill", agent_address="127.0.0.1:9",
                            generation="1", layout=layout, transport="tcp")
        yield url


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    init_none_hash(sha256)
    return env.model_dir(tmp_path_factory.mktemp("model"))


def scheduler(model: Path, role: str, engine_id: str | None = None,
              num_blocks: int = env.NUM_BLOCKS, **kw: Any) -> Scheduler:
    engine = engine_id or (env.ENGINE_P if role == "kv_producer" else env.ENGINE_D)
    cfg = env.vllm_config(model, role=role, engine_id=engine, **kw)
    kcc = env.kv_cache_config(cfg, num_blocks)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=env.BLOCK_SIZE)


def request(rid: str, params: dict[str, Any], n: int = PROMPT, *, first: int = 3,
            max_tokens: int | None = None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens or (1 if params.get("do_remote_decode") else 4),
                        extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(first, first + n)), sp, None,
                   block_hasher=get_request_block_hasher(env.BLOCK_SIZE, sha256))


def step_output(out: Any, sampled: dict[str, int], **kv: Any) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
                             kv_connector_output=KVConnectorOutput(**kv))


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def params_of(outputs: dict[int, Any], rid: str) -> dict[str, Any] | None:
    for eco in outputs.values():
        for o in eco.outputs:
            if o.request_id == rid:
                return o.kv_transfer_params
    raise AssertionError(f"no output for {rid}")


def prefill_params(model: Path, url: str, rid: str = "p1") -> tuple[Scheduler, dict[str, Any]]:
    """Runs a prefill request to its end; returns the scheduler and the decode's params."""
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": url})
    s.add_request(request(rid, {"do_remote_decode": True}))
    out = s.schedule()
    outputs = s.update_from_output(out, step_output(out, {rid: 7}))
    params = params_of(outputs, rid)
    assert params is not None
    return s, params


def test_prefill_request_binds_room_sends_table_and_delays_free(model: Path, bootstrap: str
                                                                ) -> None:
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": bootstrap})
    assert isinstance(s.connector, KVHandoffConnector)  # loaded by kv_connector_module_path
    total = free_blocks(s)
    s.add_request(request("p1", {"do_remote_decode": True}))
    out = s.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVHandoffMetadata)
    table = s.kv_cache_manager.get_block_ids("p1")[0]
    assert len(table) == 3
    room = room_of(env.ENGINE_P, "p1")
    assert meta.sends["p1"].room == room
    assert meta.sends["p1"].block_ids == table
    assert meta.sends["p1"].num_tokens == PROMPT
    assert not meta.recvs and not meta.aborts

    outputs = s.update_from_output(out, step_output(out, {"p1": 7}))
    params = params_of(outputs, "p1")
    host, port = split_addr(bootstrap)
    assert params is not None
    params.pop("remote_prefill_cached_tokens")  # vLLM adds its own prefix-cache figure
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": env.ENGINE_P, "remote_request_id": "p1", "remote_room": room,
        "remote_bootstrap_addr": f"{host}:{port}", "remote_host": host, "remote_port": port,
        "remote_block_ids": table, "remote_num_tokens": PROMPT, "tp_size": 1,
        # no decode_tp_size: a request that does not say leaves the count to the readers
    }
    assert meta.sends["p1"].decode_tp_size is None
    with BootstrapClient(bootstrap) as c:
        bound = c.room(room)
    assert (bound.state, bound.engine_id, bound.dp_rank) == ("bound", env.ENGINE_P, 0)

    # finished, but its blocks stay until the workers report the room done
    assert "p1" in s.requests
    assert free_blocks(s) == total - 3
    out = s.schedule()
    assert isinstance(out.kv_connector_metadata, KVHandoffMetadata)
    assert not out.kv_connector_metadata.sends  # one sender per request
    s.update_from_output(out, step_output(out, {}))
    assert free_blocks(s) == total - 3
    out = s.schedule()
    s.update_from_output(out, step_output(out, {}, finished_sending={"p1"}))
    assert "p1" not in s.requests
    assert free_blocks(s) == total


def test_chunked_prefill_sends_at_the_last_chunk(model: Path, bootstrap: str) -> None:
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": bootstrap}, batched_tokens=16)
    s.add_request(request("c1", {"do_remote_decode": True}))
    sends = []
    for _ in range(3):
        out = s.schedule()
        assert out.num_scheduled_tokens["c1"] == (16 if len(sends) < 2 else 8)
        sends.append(dict(out.kv_connector_metadata.sends))
        s.update_from_output(out, step_output(out, {"c1": 7} if len(sends) == 3 else {}))
    assert sends[0] == {} and sends[1] == {}
    assert sends[2]["c1"].block_ids == s.kv_cache_manager.get_block_ids("c1")[0]


def test_prefill_abort_after_send_keeps_blocks_and_aborts_the_room(model: Path, bootstrap: str
                                                                  ) -> None:
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": bootstrap})
    total = free_blocks(s)
    r = request("a1", {"do_remote_decode": True})
    r.sampling_params.max_tokens = 8
    r.max_tokens = 8
    s.add_request(r)
    out = s.schedule()
    assert "a1" in out.kv_connector_metadata.sends
    s.update_from_output(out, step_output(out, {"a1": 7}))
    s.finish_requests("a1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == total - 3  # the sender may still read them
    out = s.schedule()
    assert "a1" in out.kv_connector_metadata.aborts
    s.update_from_output(out, step_output(out, {}, finished_sending={"a1"}))
    assert free_blocks(s) == total


def test_room_not_bound_means_no_handoff(model: Path, bootstrap: str) -> None:
    """An engine the bootstrap server does not know cannot bind its rooms: the request gets no
    params (the proxy's decode computes the prompt), the workers abort the room, and the blocks
    wait for the room's release like any other."""
    s = scheduler(model, "kv_producer", engine_id="not-registered",
                  extra={"bootstrap_url": bootstrap, "bind_timeout_s": 2})
    total = free_blocks(s)
    s.add_request(request("u1", {"do_remote_decode": True}))
    out = s.schedule()
    assert "u1" in out.kv_connector_metadata.sends
    outputs = s.update_from_output(out, step_output(out, {"u1": 7}))
    assert params_of(outputs, "u1") is None
    out = s.schedule()
    assert "not registered" in out.kv_connector_metadata.aborts["u1"]
    assert free_blocks(s) == total - 3
    s.update_from_output(out, step_output(out, {}, finished_sending={"u1"}))
    assert free_blocks(s) == total


class _Said(logging.Handler):
    """Sets `said` once a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.said = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.said.set()


def test_a_bind_before_the_workers_registered_waits_for_them(model: Path, bootstrap: str
                                                             ) -> None:
    """The workers' agents register on threads of their own: a request in the first instants
    after start binds its room before the server holds the engine. The bind is tried again
    (within `bind_timeout_s`) and the request is handed off once the engine registers."""
    engine = "registers-late"
    said = _Said("trying again")
    logger = logging.getLogger("kvhandoff.vllm")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    try:
        s = scheduler(model, "kv_producer", engine_id=engine,
                      extra={"bootstrap_url": bootstrap, "bind_timeout_s": 120})
        s.add_request(request("late1", {"do_remote_decode": True}))
        out = s.schedule()
        assert "late1" in out.kv_connector_metadata.sends
        assert said.said.wait(60)  # the server refused the bind once: engine not registered
        with BootstrapClient(bootstrap) as c:
            c.register_rank(engine_id=engine, role="prefill", agent_address="127.0.0.1:9",
                            generation="1", layout=LayoutSpec(
                                page_size_tokens=16, kv_dtype="bf16", regions=(
                                    RegionSpec("kv", (0,), (Plane("kv", 64),)),)),
                            transport="tcp")
            outputs = s.update_from_output(out, step_output(out, {"late1": 7}))
            params = params_of(outputs, "late1")
            assert params is not None and params["remote_engine_id"] == engine
            assert c.room(params["remote_room"]).engine_id == engine
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)


def test_preempted_prefill_resets_its_room_and_sends_again(model: Path, bootstrap: str
                                                           ) -> None:
    """Memory for 6 blocks: a local request Q (48 tokens) and a prefill P (40 tokens, more than
    one output token) take all of them; Q's next token needs a block, the scheduler preempts P
    (the last one in): its room is reset (its blocks were freed) and, once P runs again, sent
    from its new blocks."""
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": bootstrap}, num_blocks=7)
    s.add_request(request("q", {}, n=48, first=100, max_tokens=20))
    s.add_request(request("p", {"do_remote_decode": True}, max_tokens=20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"q": 48, "p": PROMPT}
    first = out.kv_connector_metadata.sends["p"]
    s.update_from_output(out, step_output(out, {"q": 7, "p": 7}))
    out = s.schedule()
    assert out.preempted_req_ids == {"p"}
    meta = out.kv_connector_metadata
    assert "p" in meta.resets and "p" not in meta.sends and "p" not in meta.aborts
    s.update_from_output(out, step_output(out, {"q": 7}))
    s.finish_requests("q", RequestStatus.FINISHED_ABORTED)  # room for p again
    out = s.schedule()
    # resumed: its two full prompt blocks come back from the prefix cache, the rest is computed
    assert out.num_scheduled_tokens["p"] == PROMPT + 1 - 32
    again = out.kv_connector_metadata.sends["p"]
    assert again.room == first.room
    assert again.block_ids == s.kv_cache_manager.get_block_ids("p")[0]


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_decode_request_announces_remote_tokens_and_records_blocks(
        model: Path, bootstrap: str, mode: str) -> None:
    _, params = prefill_params(model, bootstrap)
    s = scheduler(model, "kv_consumer", extra={"load_mode": mode})
    s.add_request(request("d1", dict(params)))
    out = s.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVHandoffMetadata)
    table = s.kv_cache_manager.get_block_ids("d1")[0]
    rv = meta.recvs["d1"]
    assert (rv.room, rv.bootstrap_addr, rv.num_tokens) == (
        params["remote_room"], params["remote_bootstrap_addr"], PROMPT)
    assert rv.block_ids == table and len(table) == 3
    assert rv.local_tokens == 0
    if mode == "layerwise":
        # the last prompt token is computed in this very step, the rest streams in per layer
        assert rv.sync and rv.load_tokens == PROMPT - 1
        assert out.num_scheduled_tokens == {"d1": 1}
        assert not meta.idle
    else:
        assert not rv.sync and rv.load_tokens == PROMPT
        assert out.num_scheduled_tokens == {}
        # no token in this step: the workers may wait a moment for the load (worker.py)
        assert meta.idle
        assert s.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        s.update_from_output(out, step_output(out, {}, finished_recving={"d1"}))
        out = s.schedule()
        assert out.num_scheduled_tokens == {"d1": 1}
        assert not out.kv_connector_metadata.recvs  # one transfer per request
        assert not out.kv_connector_metadata.idle


def test_decode_aborted_while_loading_aborts_the_room(model: Path, bootstrap: str) -> None:
    _, params = prefill_params(model, bootstrap, rid="p5")
    s = scheduler(model, "kv_consumer", extra={"load_mode": "async"})
    total = free_blocks(s)
    s.add_request(request("d5", dict(params)))
    out = s.schedule()
    assert "d5" in out.kv_connector_metadata.recvs
    s.update_from_output(out, step_output(out, {}))
    s.finish_requests("d5", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == total - 3  # the load may still write into them
    out = s.schedule()
    assert "d5" in out.kv_connector_metadata.aborts
    s.update_from_output(out, step_output(out, {}, finished_recving={"d5"}))
    assert free_blocks(s) == total


def test_decode_with_local_prefix_loads_only_the_suffix(model: Path, bootstrap: str) -> None:
    _, params = prefill_params(model, bootstrap, rid="p2")
    s = scheduler(model, "kv_consumer")
    # a first request with the same prompt, computed locally, fills the prefix cache
    s.add_request(request("warm", {}))
    out = s.schedule()
    s.update_from_output(out, step_output(out, {"warm": 7}))
    s.finish_requests("warm", RequestStatus.FINISHED_ABORTED)
    s.add_request(request("d2", dict(params)))
    out = s.schedule()
    rv = out.kv_connector_metadata.recvs["d2"]
    assert rv.local_tokens == 32  # two full cached blocks
    assert rv.load_tokens == PROMPT - 1
    assert rv.block_ids == s.kv_cache_manager.get_block_ids("d2")[0]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_errors_follow_the_failure_policy(model: Path, bootstrap: str, policy: str) -> None:
    _, params = prefill_params(model, bootstrap, rid="p3")
    s = scheduler(model, "kv_consumer", policy=policy)
    s.add_request(request("d3", dict(params)))
    out = s.schedule()
    rv = out.kv_connector_metadata.recvs["d3"]
    failed = set(rv.block_ids)  # what the worker reports for a room that failed
    outputs = s.update_from_output(out, step_output(out, {"d3": 9}, invalid_block_ids=failed))
    if policy == "recompute":
        assert s.requests["d3"].num_computed_tokens == 0
        out = s.schedule()
        assert out.num_scheduled_tokens == {"d3": PROMPT}  # computed locally now
        assert not out.kv_connector_metadata.recvs
    else:
        assert "d3" not in s.requests
        (o,) = [o for eco in outputs.values() for o in eco.outputs if o.request_id == "d3"]
        assert o.finish_reason is not None


@pytest.mark.parametrize(("asked", "setting", "opened"), [
    (2, None, 2),  # kv_transfer_params.decode_tp_size: the proxy knows its decode
    (None, 4, 4),  # the prefill's decode_tp_size setting, for requests that do not say
    (2, 4, 2),  # the request wins
    (None, None, None),  # nothing said: opened without a count, the decode ranks give it
])
def test_prefill_opens_the_room_for_the_decode_tp_size(model: Path, bootstrap: str,
                                                       asked: int | None, setting: int | None,
                                                       opened: int | None) -> None:
    extra: dict[str, Any] = {"bootstrap_url": bootstrap}
    if setting is not None:
        extra["decode_tp_size"] = setting
    s = scheduler(model, "kv_producer", extra=extra)
    ask: dict[str, Any] = {"do_remote_decode": True}
    if asked is not None:
        ask["decode_tp_size"] = asked
    s.add_request(request("t1", ask))
    out = s.schedule()
    assert out.kv_connector_metadata.sends["t1"].decode_tp_size == opened
    params = params_of(s.update_from_output(out, step_output(out, {"t1": 7})), "t1")
    assert params is not None and params.get("decode_tp_size") == opened
    assert params["tp_size"] == 1


@pytest.mark.parametrize("bad", ["two", 0, True])
def test_bad_decode_tp_size_means_no_handoff(model: Path, bootstrap: str, bad: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    s = scheduler(model, "kv_producer", extra={"bootstrap_url": bootstrap})
    s.add_request(request("t2", {"do_remote_decode": True, "decode_tp_size": bad}))
    out = s.schedule()
    assert not out.kv_connector_metadata.sends  # no room: computed here, nothing held
    assert params_of(s.update_from_output(out, step_output(out, {"t2": 7})), "t2") is None
    assert "t2" not in s.requests
    assert "kv_transfer_params.decode_tp_size" in caplog.text


def test_decode_tp_size_setting_is_checked(model: Path) -> None:
    from kvhandoff.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_tp_size"):
        scheduler(model, "kv_producer", extra={"bootstrap_url": "http://127.0.0.1:1",
                                               "decode_tp_size": "2"})


def test_decode_of_another_tp_size_computes_locally(model: Path, bootstrap: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # the prefill opened the room for two decode ranks; this decode (TP 1) would be one reader
    # where the room waits for two: it computes the prompt itself and says why
    _, params = prefill_params(model, bootstrap, rid="p6")
    s = scheduler(model, "kv_consumer")
    s.add_request(request("d6", {**params, "decode_tp_size": 2}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"d6": PROMPT}
    assert not out.kv_connector_metadata.recvs
    assert "opened room" in caplog.text and "decode of TP 2" in caplog.text
    # ... and has the workers abort the room, so the prefill frees its blocks now
    declined = out.kv_connector_metadata.declines["d6"]
    assert (declined.room, declined.bootstrap_addr) == (params["remote_room"],
                                                        params["remote_bootstrap_addr"])


def test_bad_params_compute_locally(model: Path, bootstrap: str) -> None:
    s = scheduler(model, "kv_consumer")
    s.add_request(request("d4", {"do_remote_prefill": True, "remote_room": "x",
                                 "remote_bootstrap_addr": "127.0.0.1:1",
                                 "remote_num_tokens": PROMPT}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"d4": PROMPT}
    assert not out.kv_connector_metadata.recvs


def test_bad_extra_config_names_the_field(model: Path) -> None:
    from kvhandoff.errors import ConfigError

    with pytest.raises(ConfigError, match="bootstrap_url"):
        scheduler(model, "kv_producer")
    with pytest.raises(ConfigError, match="load_mode"):
        scheduler(model, "kv_consumer", extra={"load_mode": "eventually"})
    with pytest.raises(ConfigError, match="kv_role"):
        scheduler(model, "kv_both", extra={"bootstrap_url": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="tranport"):
        scheduler(model, "kv_consumer", extra={"settings": {"tranport": "tcp"}})


def test_plugin_registers_the_connector_by_name() -> None:
    """The `vllm.general_plugins` entry point (pyproject) registers KVHandoffConnector with
    vLLM's factory; vLLM may call it more than once."""
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvhandoff"]
    register = ep.load()
    register()
    register()
    kt = KVTransferConfig(kv_connector="KVHandoffConnector", kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(kt) is KVHandoffConnector


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_resumed_request_loads_the_room_and_computes_the_generated_tokens(
        model: Path, bootstrap: str, mode: str) -> None:
    """A request continued on this decode (``kvhandoff route``): its prompt is the original
    prompt plus 6 tokens generated elsewhere, the room covers the original prompt only
    (``kvhandoff_resume``). The decode loads the room's 40 tokens (layerwise too: the last
    token it computes is a generated one) and computes the 6 generated tokens. Without the flag
    the length mismatch is declined: the decode computes all 46."""
    _, params = prefill_params(model, bootstrap, rid="p-resume-" + mode)
    generated = list(range(200, 206))
    s = scheduler(model, "kv_consumer", extra={"load_mode": mode})
    req = request("d-resume", {**params, "kvhandoff_resume": True}, n=PROMPT + 6)
    req.prompt_token_ids[PROMPT:] = generated  # the original prompt, then what it generated
    s.add_request(req)
    out = s.schedule()
    rv = out.kv_connector_metadata.recvs["d-resume"]
    assert (rv.num_tokens, rv.local_tokens, rv.load_tokens) == (PROMPT, 0, PROMPT)
    if mode == "layerwise":
        assert rv.sync and out.num_scheduled_tokens == {"d-resume": 6}
    else:
        assert out.num_scheduled_tokens == {}
        s.update_from_output(out, step_output(out, {}, finished_recving={"d-resume"}))
        out = s.schedule()
        assert out.num_scheduled_tokens == {"d-resume": 6}

    plain = scheduler(model, "kv_consumer", extra={"load_mode": mode})
    plain.add_request(request("d-plain", dict(params), n=PROMPT + 6))
    out = plain.schedule()
    assert "d-plain" not in out.kv_connector_metadata.recvs
    assert out.num_scheduled_tokens == {"d-plain": PROMPT + 6}
