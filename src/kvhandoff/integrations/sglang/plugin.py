"""The SGLang plugin: makes ``--disaggregation-transfer-backend kvhandoff`` a backend.

SGLang has no registration API for transfer backends: ``TransferBackend`` is a closed enum and
``get_kv_class`` a hard-coded ``if`` chain. SGLang does load the entry points of the group
``sglang.srt.plugins`` (filtered by ``SGLANG_PLUGINS``) in every process before it parses
arguments or builds a scheduler, and gives plugins a hook registry. `register` (the entry point)
uses exactly those:

1. refuses any SGLang outside `SGLANG_SUPPORTED` (the classes subclass SGLang internals), the
   supported range named in the error;
2. adds the member ``KVHANDOFF = "kvhandoff"`` to ``TransferBackend``;
3. appends ``kvhandoff`` to the CLI choices (``add_disagg_transfer_backend_choices``);
4. registers an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that answers
   for ``kvhandoff`` and defers to SGLang for every other backend. SGLang applies hooks after
   all plugins ran and rebinds every ``from ... import get_kv_class`` copy; called outside
   SGLang's plugin loader, `register` applies the hooks itself.

Idempotent: a second call changes nothing. SGLang logs (and does not re-raise) an exception a
plugin raises; the version check therefore also logs an ERROR line of its own, and the backend
then stays unknown, so ``--disaggregation-transfer-backend kvhandoff`` fails at argument parsing.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from typing import Any

from kvhandoff.integrations.sglang import BACKEND_NAME, SGLANG_SUPPORTED

log = logging.getLogger("kvhandoff.sglang")

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
_lock = threading.Lock()
_registered = False


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not the version this backend was written for."""


def supported_range() -> str:
    """`SGLANG_SUPPORTED` as a pip specifier, e.g. ``>=0.5.23,<0.5.24``."""
    low, high = (".".join(map(str, v)) for v in SGLANG_SUPPORTED)
    return f">={low},<{high}"


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a PEP 440 version (``0.5.23.post1+cu128`` -> (0, 5, 23)); None
    for a pre/dev release or an unparsable string."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)((?:\.post\d+)?)(\+[\w.]+)?", version.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def is_supported(version: str) -> bool:
    rel = _release(version)
    low, high = SGLANG_SUPPORTED
    return rel is not None and low <= rel < high


def check_version(version: str | None = None) -> None:
    """Raises `UnsupportedSGLangVersion` unless SGLang is in `SGLANG_SUPPORTED`."""
    if version is None:
        import sglang

        version = str(getattr(sglang, "__version__", "unknown"))
    if not is_supported(version):
        msg = (f"kvhandoff SGLang backend: supports sglang{supported_range()}, found "
               f"sglang=={version}; not registering '{BACKEND_NAME}' (install "
               f"'kvhandoff[sglang]' to get a supported version)")
        log.error(msg)
        raise UnsupportedSGLangVersion(msg)


def _add_enum_member(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Adds a member to a plain (non-flag) Enum, or returns the existing one."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook of SGLang's ``get_kv_class``: our classes for ``kvhandoff``."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)  # SGLang's shared KVArgs
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer
    from kvhandoff.integrations.sglang.conn import KVHandoffKVManager
    from kvhandoff.integrations.sglang.receiver import KVHandoffKVReceiver
    from kvhandoff.integrations.sglang.sender import KVHandoffKVSender

    return {
        KVClassType.MANAGER: KVHandoffKVManager,
        KVClassType.SENDER: KVHandoffKVSender,
        KVClassType.RECEIVER: KVHandoffKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVHandoffKVBootstrapServer,
    }.get(class_type)


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: registers the ``kvhandoff`` backend (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        check_version()
        from sglang.srt.arg_groups.choices import (
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.plugins.hook_registry import (
            HookRegistry,
            HookType,
            _current_plugin_source,
        )

        _add_enum_member(TransferBackend, BACKEND_NAME.upper(), BACKEND_NAME)
        if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
            add_disagg_transfer_backend_choices([BACKEND_NAME])
        HookRegistry.register(GET_KV_CLASS, _get_kv_class, HookType.AROUND)
        if _current_plugin_source.get() is None:
            # called directly, not by SGLang's load_plugins (which applies hooks after all
            # plugins ran): apply now
            HookRegistry.apply_hooks()
        _registered = True
        log.info("registered SGLang transfer backend '%s'", BACKEND_NAME)
