"""One simulated engine around a `TransferAgent`: a prefill that computes layers and hands them
over, or a decode that receives and checks them (`run_prefill`, `run_decode`; `main` is
``python -m kvhandoff.engine_sim``). It prints one JSON object per line on stdout (its events).

Page contents are `kvhandoff.engine_sim.pattern`'s. Decode fills its cached-prefix indexer pages
with `PREFIX_MARKER` first and checks afterwards that the handoff left them alone (suffix-only
indexer). ``"plane_salt": true`` salts each plane's bytes by its name (`pattern.plane_salt`).

Several ranks per engine (heterogeneous TP): config keys ``tp_rank``/``tp_size`` (a head-sharded
preset then gives that rank's heads), ``dp_rank``/``dp_size`` (registration identity), per-room
``num_decode_ranks`` on the prefill side (how many decode ranks read the room from this rank),
and ``peer`` as a list on the decode side (gathering from several prefill ranks).

Prefill config ``wait_for_decode``: start computing once every room left Bootstrapping (the
decode side bootstrapped), as an engine's bootstrap queue does. ``hold_after_layer``: after
handing over that layer, wait until every room ended (e.g. the decode aborted it), then hand
over the later layers of the rooms still open only.

Both sides: ``timeout_s`` (60) bounds the wait for each room's end, ``release_wait_s`` (5)
the wait after it for the room's pages to come back (``released`` in its ``done`` event); a
failed room whose writer may still write keeps them for the write quarantine (nixl: at least
``stall_timeout_s`` + 2 heartbeats), so a test that asserts the release of such a room gives
that time.

Events: ``ready`` (agent address), ``registered`` (prefill with a bootstrap server), ``layer``
(prefill: computed and handed over; decode: landed and verified), ``done`` (per room: state,
failure, stats, verification), ``error``.

Rules: the agent is used through its public API only (`kvhandoff.transfer`); `main` reports
an error as an event, then fails loudly.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.engine_sim.pattern import PREFIX_MARKER, check_tokens, write_tokens
from kvhandoff.state_machine import KVPoll

ENDED = (KVPoll.Success, KVPoll.Failed)

def _free(pool: Any, pages: np.ndarray, room: int) -> None:
    pool.free(pages)


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": kind, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _layout(cfg: dict[str, Any]) -> Any:
    from kvhandoff.kv_layout import preset
    from kvhandoff.kv_layout.presets import PRESETS

    model = cfg.get("model", "glm-5.3")
    kw: dict[str, Any] = {}
    if cfg.get("page_size"):
        kw["page_size_tokens"] = cfg["page_size"]
    factory = PRESETS.get(model)
    if factory is not None and "tp_size" in inspect.signature(factory).parameters:
        kw["tp_size"] = int(cfg.get("tp_size", 1))  # head-sharded: this rank's heads
        kw["tp_rank"] = int(cfg.get("tp_rank", 0))
    spec = preset(model, **kw)
    if cfg.get("page_size") and not cfg.get("page_rules", False):
        # a page size chosen on purpose (P != D pairing): a simulated engine runs no attention
        # kernel, so the preset's kernel page rules (refused at agent start) are dropped;
        # "page_rules": true keeps them
        spec = spec.without_page_rules()
    return spec


def _agent(role: str, spec: Any, bufs: Any, settings: Any, cfg: dict[str, Any],
           agent_kw: dict[str, Any] | None) -> Any:
    """The agent of this rank, with its engine identity (engine_id, dp/tp rank and size);
    `agent_kw` adds keyword arguments (a transport, an effect filter: tests' faults)."""
    from kvhandoff.transfer import TransferAgent

    return TransferAgent(role, spec, bufs, settings, engine_id=cfg.get("engine_id", role),
                         dp_rank=int(cfg.get("dp_rank", 0)), dp_size=int(cfg.get("dp_size", 1)),
                         tp_rank=int(cfg.get("tp_rank", 0)), tp_size=int(cfg.get("tp_size", 1)),
                         **(agent_kw or {}))


def _buffers(spec: Any, num_pages: int, cfg: dict[str, Any]) -> Any:
    """The KV buffers: CPU torch tensors, or numpy arrays with ``"numpy_buffers": true`` (the
    agent takes both; numpy spares the process the torch import, for many-rank tests); numpy
    views of a kvhandoff shared segment with ``"shared_buffers": true`` (the shm map lane)."""
    from kvhandoff.buffers.bufferset import allocate

    if cfg.get("shared_buffers"):
        from kvhandoff.buffers.shared import allocate_shared

        return allocate_shared(spec, num_pages, numpy_arrays=True)
    if not cfg.get("numpy_buffers"):
        return allocate(spec, num_pages)
    ps = spec.page_size_tokens
    return {reg.name: {lid: np.zeros(reg.page_nbytes(ps) * num_pages, dtype=np.uint8)
                       for lid in reg.layer_ids} for reg in spec.regions}


def _settings(cfg: dict[str, Any]) -> Any:
    from kvhandoff.settings import Settings

    return Settings(**cfg.get("settings", {}))


def run_prefill(cfg: dict[str, Any], agent_kw: dict[str, Any] | None = None) -> int:
    from kvhandoff.buffers.pool import PagePool

    spec = _layout(cfg)
    settings = _settings(cfg)
    rooms = cfg["rooms"]  # [{"room": id, "seq_len": n}]
    ps = spec.page_size_tokens
    need = sum(-(-r["seq_len"] // ps) for r in rooms)
    pool = PagePool(need + cfg.get("spare_pages", 8), seed=cfg.get("seed", 0))
    bufs = _buffers(spec, pool.num_pages, cfg)
    seed = int(cfg.get("seed", 0))
    layer_s = float(cfg.get("layer_ms", 0)) / 1e3
    salt = bool(cfg.get("plane_salt", False))
    with _agent("prefill", spec, bufs, settings, cfg, agent_kw) as agent:
        _emit("ready", address=agent.address, generation=agent.generation,
              status=agent.status())
        registered = agent.wait_registered(settings.bootstrap_timeout_s)
        if registered is not None:
            _emit("registered", ok=registered)
        senders = []
        for r in rooms:
            pages = pool.alloc(-(-r["seq_len"] // ps))
            s = agent.sender(r["room"], pages=pages, seq_len=r["seq_len"],
                             on_release=functools.partial(_free, pool, pages),
                             num_decode_ranks=int(r.get("num_decode_ranks", 1)),
                             request_id=r.get("request_id"))
            senders.append((r, s, pages))
        if cfg.get("wait_for_decode"):
            # as SGLang's prefill bootstrap queue: schedule the request once its decode side
            # has bootstrapped (the room left Bootstrapping), bounded by the bootstrap timeout
            until = time.monotonic() + settings.bootstrap_timeout_s
            while time.monotonic() < until and any(
                    s.poll() is KVPoll.Bootstrapping for _, s, _ in senders):
                time.sleep(0.001)  # a scheduler tick of the simulated engine
            _emit("scheduled", states=[s.poll().name for _, s, _ in senders])
        layers = sorted({lid for reg in spec.regions for lid in reg.layer_ids})
        # hold_after_layer: N: after marking layer N, wait until every room ended, then mark
        # the later layers only of the rooms still open
        hold = cfg.get("hold_after_layer")
        for lid in layers:
            t0 = time.monotonic()
            for r, s, pages in senders:
                for ri, reg in enumerate(spec.regions):
                    if lid in reg.layer_ids:
                        write_tokens(agent.buffers.array(reg.name, lid), spec, ri, lid, pages,
                                     0, r["seq_len"], seed, salt=salt)
                if r.get("abort_at_layer") == lid:
                    s.abort("engine aborted the request")
            spent = time.monotonic() - t0
            if layer_s > spent:
                time.sleep(layer_s - spent)  # simulated compute of the layer, not a sync
            for r, s, _ in senders:
                if (r.get("abort_at_layer") is None or lid < r["abort_at_layer"]) \
                        and (hold is None or lid <= hold or s.poll() not in ENDED):
                    s.layer_ready(lid)
            _emit("layer", layer=lid)
            if lid == hold:
                # the rest of the layers wait until every room ended (a test's abort from the
                # decode mid-transfer): an event, not a pace a loaded host can outrun
                for _, s, _ in senders:
                    s.wait(float(cfg.get("timeout_s", 60)))
        _emit("all_ready")
        timeout = float(cfg.get("timeout_s", 60))
        for r, s, _ in senders:
            s.wait(timeout)
            s.wait_released(float(cfg.get("release_wait_s", 5)))
            _emit("done", room=r["room"], state=s.poll().name, failure=s.failure,
                  released=s.released, stats=s.stats(), timings=agent.room_timings(r["room"]))
        _emit("pool", free=pool.free_count, total=pool.num_pages)
        if cfg.get("linger"):
            sys.stdin.read()  # stay alive (serving) until the parent closes stdin
        _emit("status", status=agent.status())
    return 0


def run_decode(cfg: dict[str, Any], agent_kw: dict[str, Any] | None = None) -> int:
    from kvhandoff.buffers.pool import PagePool
    from kvhandoff.errors import KVHandoffError
    from kvhandoff.kv_layout import SendFrom, page_aligned
    from kvhandoff.state_machine import KVPoll

    spec = _layout(cfg)
    settings = _settings(cfg)
    rooms = cfg["rooms"]  # [{"room", "seq_len", "prefix"}]
    ps = spec.page_size_tokens
    need = sum(-(-r["seq_len"] // ps) for r in rooms)
    pool = PagePool(need + cfg.get("spare_pages", 8), seed=cfg.get("seed", 0) + 1)
    bufs = _buffers(spec, pool.num_pages, cfg)
    seed = int(cfg.get("seed", 0))
    timeout = float(cfg.get("timeout_s", 60))
    salt = bool(cfg.get("plane_salt", False))
    with _agent("decode", spec, bufs, settings, cfg, agent_kw) as agent:
        _emit("ready", address=agent.address, generation=agent.generation,
              status=agent.status())
        recvs = []
        for r in rooms:
            pages = pool.alloc(-(-r["seq_len"] // ps))
            prefix = page_aligned(int(r.get("prefix", 0)), ps)
            for reg in spec.regions:  # the cached prefix decode already holds
                if reg.send_from is SendFrom.DECODE_PREFIX and prefix:
                    for lid in reg.layer_ids:
                        view = agent.buffers.array(reg.name, lid).reshape(
                            -1, reg.page_nbytes(ps))
                        view[pages[:prefix // ps]] = PREFIX_MARKER
            rv = agent.receiver(r["room"], cfg.get("bootstrap_url"), peer=cfg.get("peer"),
                                on_release=functools.partial(_free, pool, pages),
                                request_id=r.get("request_id"))
            rv.init(pages, r["seq_len"], r.get("prefix", 0))
            if r.get("abort_at_layer") == -1:
                rv.abort("decode aborted the request")
            recvs.append((r, rv, pages, prefix))
        layers = sorted({lid for reg in spec.regions for lid in reg.layer_ids})
        for lid in layers:
            ok = True
            for _, rv, _, _ in recvs:
                try:
                    rv.wait_for_layer(lid, timeout)
                except KVHandoffError:  # failed (or timed out): reported by "done" below
                    ok = False
            for r, rv, _, _ in recvs:
                if r.get("abort_at_layer") == lid:
                    rv.abort("decode aborted the request")
            _emit("layer", layer=lid, ok=ok)
            if not ok and all(rv.poll() is KVPoll.Failed for _, rv, _, _ in recvs):
                break
        for r, rv, pages, prefix in recvs:
            state = rv.wait(timeout)
            rv.wait_released(float(cfg.get("release_wait_s", 5)))
            verify: dict[str, Any] = {}
            if state is KVPoll.Success and cfg.get("verify", True):
                bad = 0
                prefix_bad = 0
                for ri, reg in enumerate(spec.regions):
                    first = prefix if reg.send_from is SendFrom.DECODE_PREFIX else 0
                    for lid in reg.layer_ids:
                        buf = agent.buffers.array(reg.name, lid)
                        bad += check_tokens(buf, spec, ri, lid, pages[first // ps:], first,
                                            r["seq_len"], seed, salt=salt)
                        if first:
                            view = buf.reshape(-1, reg.page_nbytes(ps))
                            prefix_bad += int(np.count_nonzero(
                                view[pages[:first // ps]] != PREFIX_MARKER))
                verify = {"bad_bytes": bad, "prefix_touched_bytes": prefix_bad,
                          "byte_exact": bad == 0 and prefix_bad == 0}
            _emit("done", room=r["room"], state=state.name, failure=rv.failure,
                  released=rv.released, stats=rv.stats(), verify=verify,
                  timings=agent.room_timings(r["room"]))
        _emit("pool", free=pool.free_count, total=pool.num_pages)
        _emit("status", status=agent.status())
    return 0


def main(argv: list[str] | None = None,
         agent_kw: Callable[[], dict[str, Any]] | None = None) -> int:
    """Runs one side; `agent_kw()` (called once) adds keyword arguments to its agent."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("prefill", "decode"):
        print("usage: python -m kvhandoff.engine_sim prefill|decode '<json config>'",
              file=sys.stderr)
        return 2
    cfg = json.loads(args[1])
    import logging

    logging.basicConfig(level=os.environ.get("KVHANDOFF_LOG_LEVEL", "WARNING").upper(),
                        stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        kw = agent_kw() if agent_kw is not None else None
        return run_prefill(cfg, kw) if args[0] == "prefill" else run_decode(cfg, kw)
    except Exception as e:  # report, then fail loudly
        _emit("error", error=f"{type(e).__name__}: {e}")
        raise
