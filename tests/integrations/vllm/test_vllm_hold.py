"""The decode scheduler's holds (issue 50), through vLLM 0.33's own `Scheduler` with one
sequence at a time (``max_num_seqs=1``): a decode request of a remote prefill that vLLM queues
(no slot) is told to the workers as held (``KVHandoffMetadata.holds``: its room and bootstrap
server), once; it stops being held (``unholds``) in the step its blocks are allocated (the
step whose metadata opens its receiver) or after it ends while queued. A request admitted in
the step it arrived, a local request and one whose params do not parse are never held; a
prefill never holds.

What the workers do with it (their agents hold the rooms at the prefill ranks) is
test_vllm_holds_agents.py; the whole path on live engines is tests/live/vllm/test_live_hold.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import vllm_env as env  # noqa: E402  (this folder is on sys.path: pytest rootdir import)
from test_vllm_scheduler import prefill_params, request, step_output  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvhandoff.bootstrap_server.background import run_server  # noqa: E402
from kvhandoff.bootstrap_server.client import BootstrapClient  # noqa: E402
from kvhandoff.integrations.vllm import KVHandoffMetadata  # noqa: E402
from kvhandoff.integrations.vllm.config import HoldReq  # noqa: E402
from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec  # noqa: E402
from kvhandoff.settings import Settings  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    init_none_hash(sha256)
    return env.model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with run_server(Settings(port=0, auth_token=None)) as url:
        yield url


@pytest.fixture
def bootstrap(server: str) -> str:
    """The bootstrap server with the prefill engine's rank registered now (the prefill's
    worker would; here only schedulers run, and a registration lives `rank_ttl_s`)."""
    with BootstrapClient(server) as c:
        layout = LayoutSpec(page_size_tokens=16, kv_dtype="bf16", regions=(
            RegionSpec("kv", (0,), (Plane("kv", 64),)),))
        c.register_rank(engine_id=env.ENGINE_P, role="prefill", agent_address="127.0.0.1:9",
                        generation="1", layout=layout, transport="tcp")
    return server


def one_seq_decode(model: Path, **kw: Any) -> Scheduler:
    """A decode scheduler running one sequence at a time (vLLM's ``--max-num-seqs 1``)."""
    cfg = env.vllm_config(model, role="kv_consumer", engine_id=env.ENGINE_D,
                          extra={"load_mode": "async", **kw})
    cfg.scheduler_config.max_num_seqs = 1
    kcc = env.kv_cache_config(cfg, env.NUM_BLOCKS)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=env.BLOCK_SIZE)


def meta_of(out: Any) -> KVHandoffMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVHandoffMetadata)
    return meta


def hold_of(params: dict[str, Any]) -> HoldReq:
    return HoldReq(room=params["remote_room"], bootstrap_addr=params["remote_bootstrap_addr"])


def test_queued_requests_are_held_until_their_receiver_opens(model: Path, bootstrap: str
                                                             ) -> None:
    _, p1 = prefill_params(model, bootstrap, rid="hold-p1")
    _, p2 = prefill_params(model, bootstrap, rid="hold-p2")
    s = one_seq_decode(model)
    # a local request takes the one slot; behind it two remote prefills, a local request and
    # one whose params do not parse
    s.add_request(request("blocker", {}, first=50, max_tokens=3))
    s.add_request(request("d1", dict(p1)))
    s.add_request(request("d2", dict(p2)))
    s.add_request(request("local", {}, first=90))
    s.add_request(request("bad", {**p1, "remote_room": "x"}))
    out = s.schedule()
    meta = meta_of(out)
    assert out.num_scheduled_tokens == {"blocker": 40}
    assert meta.holds == {"d1": hold_of(p1), "d2": hold_of(p2)}
    assert meta.unholds == [] and not meta.recvs
    # nothing changed: nothing told (the workers keep the set)
    s.update_from_output(out, step_output(out, {"blocker": 7}))
    out = s.schedule()
    assert not meta_of(out).holds and not meta_of(out).unholds
    # the blocker ends: d1 gets its blocks (its receiver opens in this step) and is no longer
    # held; d2 (async loads do not take the slot) too
    s.update_from_output(out, step_output(out, {"blocker": 7}))
    s.finish_requests("blocker", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    meta = meta_of(out)
    assert set(meta.recvs) == {"d1", "d2"}
    assert meta.unholds == ["d1", "d2"] and not meta.holds
    assert meta.recvs["d1"].room == p1["remote_room"]


def test_a_request_ended_while_queued_stops_being_held(model: Path, bootstrap: str) -> None:
    _, p1 = prefill_params(model, bootstrap, rid="hold-p3")
    s = one_seq_decode(model)
    s.add_request(request("blocker", {}, first=50, max_tokens=8))
    s.add_request(request("d1", dict(p1)))
    out = s.schedule()
    assert meta_of(out).holds == {"d1": hold_of(p1)}
    s.update_from_output(out, step_output(out, {"blocker": 7}))
    s.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # the client hung up
    out = s.schedule()
    meta = meta_of(out)
    assert meta.unholds == ["d1"]
    # nothing else about it: no receiver was opened, so nothing to abort (the prefill's hold
    # lapses and it fails the room itself, counted as holds_expired)
    assert "d1" not in meta.aborts and "d1" not in meta.declines and not meta.recvs


def test_a_request_admitted_on_arrival_is_never_held(model: Path, bootstrap: str) -> None:
    _, p1 = prefill_params(model, bootstrap, rid="hold-p4")
    s = one_seq_decode(model)
    s.add_request(request("d1", dict(p1)))
    out = s.schedule()
    meta = meta_of(out)
    assert set(meta.recvs) == {"d1"}
    assert not meta.holds and not meta.unholds


def test_a_prefill_never_holds(model: Path, bootstrap: str) -> None:
    s, _ = prefill_params(model, bootstrap, rid="hold-p5")
    s.add_request(request("p-queued", {"do_remote_decode": True}, first=70))
    out = s.schedule()
    assert not meta_of(out).holds and not meta_of(out).unholds
