"""The checksum policy of a session: which layers are summed, which algorithm a room uses, and
which checksum modes two peers may pair. Pure functions, sans-IO.

Rules:
- Every checksum decision of the protocol is made here; the algorithms themselves (and their
  names, `ChecksumAlg`) are `buffers.checksum` / `buffers.devsum`, which compute and never
  decide.
- Modes (`settings.ChecksumMode`) go from the weakest to the strictest: off (no layer), sampled
  (every `SAMPLE_EVERY`-th layer and the last), full (every layer); each one's layers include
  the previous one's. A decode verifies a layer only against the sum its prefill sent, so a
  prefill that sums fewer layers than its decode verifies is refused at the handshake.
- A room's algorithm follows from where both sides' buffers live, which each side knows from
  its own buffers and the other's Hello: both compute the same one.
"""

from __future__ import annotations

from kvhandoff.buffers.checksum import ChecksumAlg
from kvhandoff.settings import ChecksumMode

__all__ = ["MODE_ORDER", "SAMPLE_EVERY", "ChecksumAlg", "ChecksumMode", "checksum_alg",
           "checksum_problem", "wants_checksum"]

SAMPLE_EVERY = 8
#: the checksum modes from the weakest to the strictest
MODE_ORDER = (ChecksumMode.OFF, ChecksumMode.SAMPLED, ChecksumMode.FULL)


def wants_checksum(mode: ChecksumMode, layer_index: int, num_layers: int) -> bool:
    """Whether the layer at position `layer_index` (0-based, in layer order) is summed."""
    if mode is ChecksumMode.OFF:
        return False
    if mode is ChecksumMode.FULL:
        return True
    return layer_index % SAMPLE_EVERY == 0 or layer_index == num_layers - 1


def checksum_problem(prefill: str, decode: str) -> str | None:
    """Why a prefill summing by mode `prefill` cannot serve a decode verifying by mode
    `decode` (None: it can), each as a Hello says it: the decode checks landed bytes only
    against the sums the prefill sends, so a prefill that sums fewer layers than the decode
    requires would leave layers unverified while the decode believes them checked. Both sides
    compute the same answer and refuse each other, naming both modes. An empty mode (an older
    peer that does not say) is not refused here; its layers are checked as their sums come."""
    names = [m.value for m in MODE_ORDER]
    for side, mode in (("prefill", prefill), ("decode", decode)):
        if mode and mode not in names:
            return f"checksum: {side} says {mode!r}; expected one of {', '.join(names)}"
    if prefill and decode and names.index(prefill) < names.index(decode):
        return (f"checksum: decode={decode!r} verifies more layers than prefill={prefill!r} "
                f"sums; set the prefill's checksum to {decode!r} (or the decode's to "
                f"{prefill!r})")
    return None


def checksum_alg(mine: str, theirs: str) -> ChecksumAlg:
    """The checksum algorithm of a room between an agent whose buffers live in `mine` and a
    peer whose buffers live in `theirs` (each "host" or "cuda"): devsum (computed where the
    bytes are; a host side computes the same value on the CPU) when either side's buffers are
    device memory, else xxh3 over host bytes."""
    return ChecksumAlg.DEVSUM if "cuda" in (mine, theirs) else ChecksumAlg.XXH3
