"""Importing SGLang 0.5.23's disaggregation modules on a CPU-only test machine.

THE LINE: ``sglang/srt/disaggregation/utils.py`` imports ``sglang.srt.configs``, whose
``__init__`` imports ``configs/nano_nemotron_vl.py`` -> ``multimodal/internvl_utils.py`` line 5
``import torchvision.transforms`` (and ``configs/deepseek_ocr.py`` line 7 ``from
torchvision.transforms import InterpolationMode``). Only CUDA builds of torchvision exist for
this torch here (the PyPI wheel bundles libcudart and fails to load its ops against the CPU
torch), so torchvision is not installed.

`install()` (tests only, never product code) therefore registers an inert stand-in module
``torchvision`` (+ ``.transforms``, ``.transforms.functional``) when, and only when, torchvision
is not importable. Those SGLang modules only *name* its attributes at import time (image
preprocessing for vision models); any use raises. Before that, transformers is asked once
whether torchvision is available (answer cached: False), so transformers never mistakes the
stand-in for a real install. Nothing of the disaggregation code path touches torchvision.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"{self._name}.{attr}: torchvision is not installed (CPU test "
                           "stand-in, tests/integrations/sglang/sglang_cpu_import.py)")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name}(): torchvision is not installed (CPU test stand-in)")


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so submodule imports resolve to the stand-ins
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(attr: str, _name: str = name) -> object:  # noqa: N807
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{_name}.{attr}")

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = mod
    return mod


def install() -> bool:
    """Registers the torchvision stand-in if torchvision is missing; whether it did."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():  # pragma: no cover - cached False expected
        return False
    tv, tr, fn = (_module("torchvision"), _module("torchvision.transforms"),
                  _module("torchvision.transforms.functional"))
    tv.transforms = tr  # type: ignore[attr-defined]
    tr.functional = fn  # type: ignore[attr-defined]
    return True
