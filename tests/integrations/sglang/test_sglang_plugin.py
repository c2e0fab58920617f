"""The plugin really registers with SGLang: enum, get_kv_class (everywhere SGLang imported it),
the CLI parser; idempotent; refuses other SGLang versions; the bootstrap server class; KVArgs
that the backend cannot move are refused at startup, naming the state type."""

from __future__ import annotations

import argparse
import re

import httpx
import pytest
import sglang_env as E

from kvhandoff.errors import ConfigError
from kvhandoff.kv_layout import layout_diff, layout_hash

pytestmark = pytest.mark.usefixtures("sglang_loaded")


def test_backend_is_registered_through_sglangs_plugin_loader() -> None:
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.managers.disagg_service as disagg_service
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer
    from kvhandoff.integrations.sglang.conn import KVHandoffKVManager
    from kvhandoff.integrations.sglang.receiver import KVHandoffKVReceiver
    from kvhandoff.integrations.sglang.sender import KVHandoffKVSender

    backend = TransferBackend("kvhandoff")
    assert backend.name == "KVHANDOFF" and backend is TransferBackend.KVHANDOFF
    want = {KVClassType.MANAGER: KVHandoffKVManager, KVClassType.SENDER: KVHandoffKVSender,
            KVClassType.RECEIVER: KVHandoffKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: KVHandoffKVBootstrapServer,
            KVClassType.KVARGS: KVArgs}
    # the copies prefill.py, decode.py and disagg_service.py imported are rebound too
    for fn in (get_kv_class, prefill.get_kv_class, decode.get_kv_class,
               disagg_service.get_kv_class):
        for kind, cls in want.items():
            assert fn(backend, kind) is cls, (fn.__module__, kind)
    assert get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager
    # SGLang's own check for a bootstrap server of a backend's own (not the Rust registry's)
    assert disagg_service.rust_server_serves_kv_bootstrap("kvhandoff") is False


def test_server_args_parser_accepts_the_backend() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvhandoff"])
    assert args.disaggregation_transfer_backend == "kvhandoff"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend",
                           "kvhandof"])


def test_register_is_idempotent() -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import TransferBackend

    from kvhandoff.integrations.sglang import plugin

    before = list(TransferBackend)
    plugin.register()
    plugin.register()
    assert list(TransferBackend) == before
    assert [m.value for m in TransferBackend].count("kvhandoff") == 1
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvhandoff") == 1


def test_other_sglang_versions_are_refused(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    import sglang

    from kvhandoff.integrations.sglang import plugin

    plugin.check_version()  # the installed one is a supported one
    for ok in ("0.5.23", "0.5.23.post1", "0.5.23+cu128"):  # its post releases and builds
        plugin.check_version(ok)
    for version in ("0.5.24", "0.5.22", "0.6.0", "0.5.23rc1", "unknown"):
        monkeypatch.setattr(sglang, "__version__", version)
        with pytest.raises(plugin.UnsupportedSGLangVersion,
                           match=rf"supports sglang>=0\.5\.23,<0\.5\.24, found sglang=="
                                 rf"{re.escape(version)}"):
            plugin.check_version()
    assert any("0.5.24" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


def test_unsupported_state_types_are_refused_by_name() -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    from kvhandoff.integrations.sglang.layout import Parallel, build

    p = E.pools()
    a = E.kv_args(p)
    a.state_types = [StateType.DSA, StateType.SWA, StateType.SWA_RING]
    with pytest.raises(ConfigError, match=r"state_types\[2\].*'swa_ring'.*DeepSeek-V4"):
        build(a, is_mla=True, parallel=Parallel(), device="cpu")


def test_layout_maps_kvargs_and_its_hash_covers_sglangs_checks() -> None:
    from kvhandoff.integrations.sglang.layout import Parallel, build

    p = E.pools()
    a = E.kv_args(p)
    b = build(a, is_mla=True, parallel=Parallel(), device="cpu")
    lay = b.kv_layout
    assert [r.name for r in lay.regions] == ["kv", "indexer"]
    assert lay.region("kv").bytes_per_token == E.MAIN_BPT
    assert lay.region("indexer").bytes_per_token == E.INDEXER_BPT
    assert lay.region("indexer").send_from.value == "decode_prefix"
    assert lay.page_size_tokens == E.PAGE and lay.kv_dtype == E.DTYPE
    # one aux region per buffer of SGLang's MetadataBuffers.get_buf_infos()
    assert [r.name for r in b.aux_layout.regions] == [  # type: ignore[union-attr]
        f"aux{i}" for i in range(len(a.aux_data_ptrs))]
    # zero-copy: the agent's views are SGLang's memory
    b.kv_buffers["kv"][0][7] = 42
    assert int(p.main[0].view(-1)[7]) == 42

    def ident(**kw: object) -> object:
        a2 = E.kv_args(p)
        par = Parallel(**{k: v for k, v in kw.items() if k in ("pp_size", "attn_tp_size")})
        for k, v in kw.items():
            if hasattr(a2, k):
                setattr(a2, k, v)
        mla = bool(kw.get("is_mla", True))
        if not mla:
            a2.state_types = []
            a2.kv_data_ptrs, a2.kv_data_lens = a2.kv_data_ptrs[:4], a2.kv_data_lens[:4]
            a2.kv_item_lens, a2.kv_layer_ids = a2.kv_item_lens[:4], [0, 1, 0, 1]
        lay = build(a2, is_mla=mla, parallel=par, device="cpu").kv_layout
        # what the agents compare at the handshake (page sizes and TP heads aside)
        return lay.with_page_size(1).tp_invariant()

    base = ident()
    for change in ({"kv_cache_dtype_str": "bfloat16"}, {"pp_size": 2}):
        assert layout_diff(base, ident(**change)), change  # type: ignore[arg-type]
    # page size: SGLang requires equal page sizes; the agent pairs different ones, so the
    # page size is part of the identity the handshake compares
    a3 = E.kv_args(p)
    a3.page_size = E.PAGE * 2
    lay3 = build(a3, is_mla=True, parallel=Parallel(), device="cpu").kv_layout
    assert layout_diff(base, lay3.with_page_size(1).tp_invariant())  # type: ignore[arg-type]
    # a non-MLA pool whose rows cannot be cut into the TP slices (656 B rows at TP 2) moves
    # rank to rank: the attention TP size is in it
    gqa = ident(is_mla=False, attn_tp_size=2)
    assert layout_diff(gqa, ident(is_mla=False, attn_tp_size=4))  # type: ignore[arg-type]
    assert layout_hash(lay) != layout_hash(lay3)


def test_bootstrap_server_in_process_and_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    try:
        assert not srv.sidecar and srv.port > 0
        assert httpx.get(f"{srv.url}/health").status_code == 200
        # SGLang's route before any prefill registered: 503, as SGLang's own server answers
        r = httpx.get(f"{srv.url}/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                   "target_tp_rank": -1, "target_pp_rank": -1})
        assert r.status_code == 503
        # the node's sidecar: used when KVHANDOFF_BOOTSTRAP_URL is set, nothing started
        monkeypatch.setenv("KVHANDOFF_BOOTSTRAP_URL", srv.url)
        side = KVHandoffKVBootstrapServer("127.0.0.1", srv.port)
        assert side.sidecar and side.url == srv.url and side._server is None
        with pytest.raises(ConfigError, match="disaggregation-bootstrap-port"):
            KVHandoffKVBootstrapServer("127.0.0.1", srv.port + 1)
    finally:
        srv.close()


def test_unsupported_topologies_are_refused_at_startup() -> None:
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.runtime_context import get_parallel

    sa = E.server_args("prefill", 1)
    manager = get_kv_class(TransferBackend("kvhandoff"), KVClassType.MANAGER)
    with get_parallel().override(pp_size=2), \
            pytest.raises(ConfigError, match=r"does not support: pp_size=2"):
        manager(E.kv_args(E.pools()), DisaggregationMode.PREFILL, sa, True)
