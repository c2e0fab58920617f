"""SGLang transfer backend ``kvhandoff`` (``--disaggregation-transfer-backend kvhandoff``).

Installed as an SGLang plugin (entry point group ``sglang.srt.plugins``, see `plugin`): it adds
``kvhandoff`` to SGLang's ``TransferBackend`` enum, to the CLI choices and to ``get_kv_class``.
The classes live in `conn` (manager, sender, receiver on SGLang's ``Common*`` classes, backed
by `kvhandoff.transfer.TransferAgent`) and `bootstrap` (the bootstrap server). `layout` maps
SGLang's ``KVArgs`` to kvhandoff layouts. Written for SGLang ``SGLANG_VERSION`` exactly.

Importing this package imports nothing of SGLang; `conn` and `bootstrap` do.
"""

SGLANG_VERSION = "0.5.23"
BACKEND_NAME = "kvhandoff"

__all__ = ["BACKEND_NAME", "SGLANG_VERSION"]
