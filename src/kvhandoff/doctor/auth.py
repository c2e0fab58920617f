"""Authentication check: whether the agents (``agent_host``, ``hmac_secret``) and the bootstrap
server (``host``, ``auth_token``) of this node's settings would listen where others reach them
without a secret.

Rules: the same decision the agent and the server take at start (`settings.listener_auth`):
a non-loopback address without its secret FAILs (they would refuse to start) unless
``allow_unauthenticated`` is set, which WARNs (they start with auth off). A loopback address
without a secret is OK (only this host reaches it).
"""

from __future__ import annotations

from kvhandoff.errors import ConfigError
from kvhandoff.settings import AuthMode, Settings, listener_auth

from .model import CheckResult, Status

_LISTENERS = (("agents", "agent_host", "hmac_secret"),
              ("bootstrap server", "host", "auth_token"))


def check_auth(settings: Settings) -> CheckResult:
    """How the agents and the bootstrap server of these settings authenticate their peers."""
    modes: dict[str, str] = {}
    refused: list[str] = []
    off: list[str] = []
    for what, host_setting, secret_setting in _LISTENERS:
        try:
            mode = listener_auth(settings, what=what, host_setting=host_setting,
                                 secret_setting=secret_setting, warn=False)
        except ConfigError as e:
            modes[what] = "refused"
            refused.append(str(e))
            continue
        modes[what] = mode.value
        if mode is AuthMode.OFF:
            off.append(f"{what} on {host_setting}={getattr(settings, host_setting)!r} without "
                       f"{secret_setting}")
    if refused:
        return CheckResult("auth", Status.FAIL, "; ".join(refused), details=modes,
                           fix="set KVHANDOFF_HMAC_SECRET / KVHANDOFF_AUTH_TOKEN (e.g. from a "
                           "Kubernetes Secret), or bind loopback addresses")
    if off:
        return CheckResult("auth", Status.WARN, "auth off (KVHANDOFF_ALLOW_UNAUTHENTICATED): "
                           + "; ".join(off), details=modes,
                           fix="set KVHANDOFF_HMAC_SECRET / KVHANDOFF_AUTH_TOKEN and unset "
                           "KVHANDOFF_ALLOW_UNAUTHENTICATED")
    return CheckResult("auth", Status.OK, ", ".join(f"{k}: {v}" for k, v in modes.items()),
                       details=modes)
