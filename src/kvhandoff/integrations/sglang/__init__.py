"""SGLang transfer backend ``kvhandoff`` (``--disaggregation-transfer-backend kvhandoff``).

Installed as an SGLang plugin (entry point group ``sglang.srt.plugins``, see `plugin`): it adds
``kvhandoff`` to SGLang's ``TransferBackend`` enum, to the CLI choices and to ``get_kv_class``.
The classes live in `conn` (manager, sender, receiver on SGLang's ``Common*`` classes, backed
by `kvhandoff.transfer.TransferAgent`) and `bootstrap` (the bootstrap server). `layout` maps
SGLang's ``KVArgs`` to kvhandoff layouts. Supports the SGLang releases `SGLANG_SUPPORTED`
describes (what the tests run against: `SGLANG_VERSION`; the package registry has no newer
0.5.x patch release): the 0.5.23 patch release with its post releases and local builds.

Importing this package imports nothing of SGLang; `conn` and `bootstrap` do.
"""

SGLANG_VERSION = "0.5.23"  # the version the tests install and run
# supported: release numbers in [low, high): "0.5.23", "0.5.23.post1", "0.5.23+cu128"
SGLANG_SUPPORTED = ((0, 5, 23), (0, 5, 24))
BACKEND_NAME = "kvhandoff"

__all__ = ["BACKEND_NAME", "SGLANG_SUPPORTED", "SGLANG_VERSION"]
