"""The ``vllm.general_plugins`` entry point: registers ``KVHandoffConnector`` by name with vLLM's
connector factory, so ``--kv-transfer-config '{"kv_connector": "KVHandoffConnector", ...}'``
works without ``kv_connector_module_path``. vLLM calls it in every process it starts (and may
call it more than once); registering again is a no-op.
"""

from __future__ import annotations

NAME = "KVHandoffConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, "kvhandoff.integrations.vllm.connector",
                                              NAME)
    except ValueError:  # "already registered": an earlier call in this process
        return
