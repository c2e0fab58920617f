"""The vLLM connector's lane choice: the one every integration shares
(`kvhandoff.integrations.lanes`), kept importable here for the worker."""

from __future__ import annotations

from kvhandoff.integrations.lanes import DEVICE_KINDS, NIXL_INSTALL, choose_lane, nixl_missing

__all__ = ["DEVICE_KINDS", "NIXL_INSTALL", "choose_lane", "nixl_missing"]
