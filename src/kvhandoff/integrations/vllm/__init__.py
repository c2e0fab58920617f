"""kvhandoff as a vLLM (0.33) v1 KV connector: ``pip install kvhandoff[vllm]``, then
``--kv-transfer-config '{"kv_connector": "KVHandoffConnector",
"kv_connector_module_path": "kvhandoff.integrations.vllm", ...}'`` (docs/VLLM.md).

Lazy: importing this package imports neither vLLM nor the connector (vLLM's plugin loader
imports `plugin` early in every process); ``KVHandoffConnector`` loads on first access.
`layout` and `params` never import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.integrations.vllm.connector import KVHandoffConnector, KVHandoffMetadata

__all__ = ["KVHandoffConnector", "KVHandoffMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvhandoff.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
