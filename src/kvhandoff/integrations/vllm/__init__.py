"""kvhandoff as a vLLM (0.33) v1 KV connector: ``pip install kvhandoff[vllm]``, then
``--kv-transfer-config '{"kv_connector": "KVHandoffConnector",
"kv_connector_module_path": "kvhandoff.integrations.vllm", ...}'`` (docs/VLLM.md).

Importing this package imports vLLM; `layout` and `params` do not.
"""

from kvhandoff.integrations.vllm.connector import KVHandoffConnector, KVHandoffMetadata

__all__ = ["KVHandoffConnector", "KVHandoffMetadata"]
