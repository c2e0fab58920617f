"""Which prefill ranks a decode rank talks to: TP, CP and PP mapping (pure functions).

Rules:
- TP, equal sizes: 1:1. Decode TP ``D`` > prefill TP ``P``: decode rank ``d`` reads from prefill
  rank ``d * P // D`` (several decode ranks share one prefill rank). ``D < P``: decode rank ``d``
  reads the ``P / D`` prefill ranks ``d*P/D … (d+1)*P/D - 1`` (each holds a slice of the heads).
  Sizes must divide one another.
- A replicated region (MLA latent, indexer K) is whole on every prefill rank, so one source is
  enough: ``replicated=True`` returns exactly one rank, ``d % P``, which spreads the decode ranks
  over the prefill ranks.
- CP and PP: equal sizes map 1:1; a decode size of 1 reads from every prefill rank of that axis
  (prefill CP shards the sequence and prefill PP the layers, so all of them hold a part).
- No I/O, no clock: callers turn `ConfigError` into a 400.
"""

from __future__ import annotations

from kvhandoff.errors import ConfigError


def prefill_tp_ranks(
    decode_tp_rank: int, decode_tp_size: int, prefill_tp_size: int, *, replicated: bool = False
) -> list[int]:
    """Prefill TP ranks that decode TP rank ``decode_tp_rank`` of ``decode_tp_size`` reads from.

    Raises:
        ConfigError: a size is < 1, the rank is out of range, or the sizes do not divide.
    """
    d, big_d, big_p = decode_tp_rank, decode_tp_size, prefill_tp_size
    _check_rank("tp_rank", d, "tp_size", big_d)
    if big_p < 1:
        raise ConfigError(f"prefill tp_size: expected >= 1, got {big_p}")
    if big_d % big_p and big_p % big_d:
        raise ConfigError(
            f"tp_size: decode tp_size={big_d} and prefill tp_size={big_p} must divide one "
            "another (e.g. 4 and 8)"
        )
    if replicated:
        return [d % big_p]
    if big_d == big_p:
        return [d]
    if big_d > big_p:
        return [d * big_p // big_d]
    step = big_p // big_d
    return list(range(d * step, (d + 1) * step))


def prefill_axis_ranks(
    axis: str, decode_rank: int, decode_size: int, prefill_size: int
) -> list[int]:
    """CP or PP ranks of prefill to read from: 1:1 when sizes agree; all when decode has one."""
    _check_rank(f"{axis}_rank", decode_rank, f"{axis}_size", decode_size)
    if decode_size == prefill_size:
        return [decode_rank]
    if decode_size == 1:
        return list(range(prefill_size))
    raise ConfigError(
        f"{axis}_size: decode {axis}_size={decode_size} must equal prefill "
        f"{axis}_size={prefill_size} or be 1"
    )


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if size < 1:
        raise ConfigError(f"{size_name}: expected >= 1, got {size}")
    if not 0 <= rank < size:
        raise ConfigError(
            f"{rank_name}: expected 0 <= {rank_name} < {size_name}={size}, got {rank}"
        )
