"""The bootstrap URL an SGLang rank derives from its host: an IPv6 host in brackets, once."""

from __future__ import annotations

import pytest


def test_sglang_bootstrap_url_ipv6(sglang_loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.integrations.sglang.conn import bootstrap_url_for

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    assert bootstrap_url_for("::", 8998) == "http://[::1]:8998"
    assert bootstrap_url_for("[::1]", 8998) == "http://[::1]:8998"
    assert bootstrap_url_for("0.0.0.0", 8998) == "http://127.0.0.1:8998"
    assert bootstrap_url_for("fd00::5", 1) == "http://[fd00::5]:1"
