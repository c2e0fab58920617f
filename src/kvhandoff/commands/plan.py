"""`kvhandoff plan`: the capacity and transfer-time tables of a layout, and (with
``--prefill-tp/--decode-tp/--prefill-page/--decode-page``) the plan of a heterogeneous pair:
which ranks talk to which, descriptors per request before/after coalescing for a random page
order, bytes per rank.

Also the remaining accounts of the seeds (issue 17): the handoff at realistic link efficiency
(``--link-efficiency``, 60-80 % of line rate for 64-token pages) against the measured 0.5-1 s,
the TTFT tail (prefill + last layer + first decode step; ``--prefill-s``/``--first-step-s``),
admission capacity of ``--memory-gb`` in SGLang's and vLLM's terms, the tail-page waste of
``--requests`` requests, and the layout's kernel page rules.

With ``--memory-gb`` also the admission of one request of ``--context`` prompt tokens and
``--new-tokens`` generated ones (``--prefix`` of them cached): each line (the pages of every
region for prompt + output, rounded to pages; the indexer workspace: top-k index buffer and
logits) and the verdict, refused with the reason when it does not fit, also when it fits only
without its output. ``--dcp-size`` > 1 is refused (not modelled)."""

from __future__ import annotations

import inspect
import json
from typing import Any

import typer

PAIR_SEED = 0  # the random page order of the pair plan (each rank its own permutation)
MEASURED_S = (0.5, 1.0)  # the handoff of a 1M-token GLM-5.3 request as measured (seed 003)
DEFAULT_EFFICIENCY = [0.6, 0.8]


def _rank_layout(model: str, tp_size: int, tp_rank: int, page: int | None,
                 indexer_layers: int | None) -> Any:
    """The layout of one TP rank: head-sharded presets take the rank, replicated ones do not."""
    from kvhandoff.kv_layout import preset
    from kvhandoff.kv_layout.presets import PRESETS

    kw: dict[str, int | None] = {"page_size_tokens": page}
    factory = PRESETS.get(model)
    params = inspect.signature(factory).parameters if factory is not None else {}
    if "tp_size" in params:
        kw["tp_size"], kw["tp_rank"] = tp_size, tp_rank
    if "indexer_layers" in params:
        kw["indexer_layers"] = indexer_layers
    return preset(model, **kw)


def pair_plan(model: str, *, context: int, prefix: int, prefill_tp: int, decode_tp: int,
              prefill_page: int | None, decode_page: int | None,
              indexer_layers: int | None = None, seed: int = PAIR_SEED) -> dict[str, Any]:
    """The plan of one request between a prefill engine of `prefill_tp` ranks and a decode
    engine of `decode_tp` ranks, as the agents would run it: the bootstrap server's TP mapping
    picks each decode rank's prefill ranks, each leg claims the planes it brings (first source
    first, as the agent does), `build_spans` plans every region over random page tables.

    Raises:
        ConfigError: TP sizes that do not split the heads or one another, a bad page size.
    """
    import numpy as np

    from kvhandoff.bootstrap_server.mapping import prefill_tp_ranks
    from kvhandoff.errors import ConfigError
    from kvhandoff.kv_layout import SendFrom, TPSplit, build_spans, page_aligned

    if context <= 0:
        raise ConfigError(f"context: expected > 0, got {context}")
    pre = [_rank_layout(model, prefill_tp, p, prefill_page, indexer_layers)
           for p in range(prefill_tp)] if prefill_tp > 0 else []
    dec = [_rank_layout(model, decode_tp, d, decode_page, indexer_layers)
           for d in range(decode_tp)] if decode_tp > 0 else []
    if not pre or not dec:
        raise ConfigError(f"tp: expected >= 1, got prefill={prefill_tp} decode={decode_tp}")
    replicated = all(r.tp_split is TPSplit.REPLICATED for r in dec[0].regions)
    rng = np.random.default_rng(seed)

    def table(spec: Any) -> Any:
        return rng.permutation(-(-context // spec.page_size_tokens)).astype(np.int64)

    pre_pages = [table(s) for s in pre]
    prefix = min(max(prefix, 0), context)
    sent = [0] * prefill_tp
    served: list[list[int]] = [[] for _ in range(prefill_tp)]
    ranks = []
    for d, dspec in enumerate(dec):
        sources = prefill_tp_ranks(d, decode_tp, prefill_tp, replicated=replicated)
        dpages, dps = table(dspec), dspec.page_size_tokens
        held = page_aligned(prefix, dps)
        claimed: dict[str, set[str]] = {r.name: set() for r in dspec.regions}
        legs: list[dict[str, Any]] = []
        for p in sources:
            pspec, pps = pre[p], pre[p].page_size_tokens
            planes: dict[str, list[str]] = {}
            nbytes = before = after = 0
            for reg in dspec.regions:
                src_reg = pspec.region(reg.name)
                theirs = {pl.name for pl in src_reg.planes}
                mine = [pl.name for pl in reg.planes
                        if pl.name in theirs and pl.name not in claimed[reg.name]]
                claimed[reg.name].update(mine)
                planes[reg.name] = mine
                if not mine:
                    continue
                first = held if reg.send_from is SendFrom.DECODE_PREFIX else 0
                sp = build_spans(
                    src_reg, token_start=first, token_end=context,
                    src_pages=pre_pages[p][page_aligned(first, pps) // pps:],
                    src_page_size=pps, src_first_token=page_aligned(first, pps),
                    dst_pages=dpages[page_aligned(first, dps) // dps:], dst_page_size=dps,
                    dst_first_token=page_aligned(first, dps), dst_region=reg, planes=mine)
                layers = reg.num_live_layers
                nbytes += sp.total_bytes * layers
                before += sp.descriptors_before * layers
                after += sp.count * layers
            sent[p] += nbytes
            served[p].append(d)
            legs.append({"prefill_rank": p, "planes": planes, "bytes": nbytes,
                         "descriptors_before": before, "descriptors": after})
        missing = {k: [pl.name for pl in dspec.region(k).planes if pl.name not in v]
                   for k, v in claimed.items()}
        if any(missing.values()):
            raise ConfigError(f"decode rank {d}: no prefill rank holds planes {missing}")
        ranks.append({
            "rank": d, "sources": sources, "legs": legs,
            "bytes": sum(leg["bytes"] for leg in legs),
            "descriptors_before": sum(leg["descriptors_before"] for leg in legs),
            "descriptors": sum(leg["descriptors"] for leg in legs)})
    return {
        "model": model, "context": context, "prefix": prefix,
        "prefill_tp": prefill_tp, "decode_tp": decode_tp,
        "prefill_page": pre[0].page_size_tokens, "decode_page": dec[0].page_size_tokens,
        "split": "replicated" if replicated else "head_sharded",
        "page_order": f"random (seed {seed})",
        "decode_ranks": ranks,
        "prefill_ranks": [{"rank": p, "decode_ranks": served[p], "bytes": sent[p]}
                          for p in range(prefill_tp)],
        "total_bytes": sum(sent),
        "descriptors_before": sum(r["descriptors_before"] for r in ranks),
        "descriptors": sum(r["descriptors"] for r in ranks),
    }


def _planes_text(planes: dict[str, list[str]], split: str) -> str:
    """What a leg brings: "all" (replicated), head planes "h0,h1", or "-" (an idle leg: another
    source of the same decode rank claimed those heads first)."""
    if split == "replicated":
        return "all" if any(planes.values()) else "-"
    names = list(dict.fromkeys(n for v in planes.values() for n in v))
    return ",".join(names) if names else "-"


def _print_pair(con: Any, pp: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"{pp['model']} pair: prefill TP{pp['prefill_tp']} page "
              f"{pp['prefill_page']} -> decode TP{pp['decode_tp']} page {pp['decode_page']} "
              f"({pp['split']}), {pp['context']:,} tokens, prefix {pp['prefix']:,}; "
              f"descriptors per request, page order {pp['page_order']}")
    for col in ("decode rank", "prefill rank", "planes", "bytes", "descriptors before",
                "descriptors after"):
        t.add_column(col, justify="left" if col == "planes" else "right")
    for r in pp["decode_ranks"]:
        for leg in r["legs"]:
            t.add_row(str(r["rank"]), str(leg["prefill_rank"]),
                      _planes_text(leg["planes"], pp["split"]), f"{leg['bytes']:,}",
                      f"{leg['descriptors_before']:,}", f"{leg['descriptors']:,}")
    t.add_row("total", "", "", f"{pp['total_bytes']:,}", f"{pp['descriptors_before']:,}",
              f"{pp['descriptors']:,}")
    con.print(t)
    for p in pp["prefill_ranks"]:
        to = ", ".join(map(str, p["decode_ranks"])) or "none"
        con.print(f"prefill rank {p['rank']} -> decode ranks {to}: sends {_fmt_bytes(p['bytes'])}")


def accounts(spec: Any, p: Any, *, efficiencies: tuple[float, ...], memory_gb: float | None,
             requests: int, prefix: int = 0, prefill_s: float | None = None,
             first_step_s: float | None = None, new_tokens: int = 0,
             workspace: Any = None, dcp_size: int = 1) -> dict[str, Any]:
    """The seeds' remaining accounts of `spec` at the plan `p` (plain data, as --json prints).

    Raises:
        ConfigError: an efficiency outside (0, 1], memory <= 0, requests < 0.
    """
    from kvhandoff.errors import ConfigError
    from kvhandoff.kv_layout import (
        GB,
        capacity,
        check_page_rules,
        link_accounts,
        tail_waste,
        ttft_tail,
    )

    links = link_accounts(p, efficiencies)
    tail = ttft_tail(spec, p, decode_prefix_len=prefix, efficiencies=efficiencies)
    waste = tail_waste(spec, requests=requests)
    out: dict[str, Any] = {
        "page_rules": {"rules": [f"{r.region}: {r.describe()}" for r in spec.page_rules],
                       "problems": check_page_rules(spec)},
        "link": [{"efficiency": a.efficiency, "bytes_per_s": a.bytes_per_s,
                  "transfer_s": a.transfer_s} for a in links],
        # the measurement is of a 1M-token GLM-5.3 request: compared only for that one
        "measured_s": list(MEASURED_S) if _measured_applies(spec, p) else None,
        "measured_over_ideal": ([m / p.transfer_s for m in MEASURED_S]
                                if _measured_applies(spec, p) else None),
        "ttft_tail": {"last_layer": tail.last_layer, "regions": list(tail.regions),
                      "last_layer_bytes": tail.last_layer_bytes,
                      "last_layer_s": tail.last_layer_s,
                      "last_layer_s_at": [{"efficiency": e, "s": t}
                                          for e, t in tail.last_layer_s_at],
                      "prefill_s": prefill_s, "first_step_s": first_step_s,
                      "floor_s": (tail.floor_s(prefill_s, first_step_s)
                                  if prefill_s is not None and first_step_s is not None
                                  else None)},
        "tail_waste": {"requests": waste.requests, "avg_tokens": waste.avg_tokens,
                       "per_request_bytes": waste.per_request_bytes,
                       "total_bytes": waste.total_bytes},
    }
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ConfigError(f"memory_gb: expected > 0, got {memory_gb}")
        c = capacity(spec, available_bytes=int(round(memory_gb * GB)),
                     context_tokens=p.context_tokens)
        out["capacity"] = {
            "available_bytes": c.available_bytes, "cell_size": c.cell_size,
            "max_total_num_tokens": c.max_total_num_tokens,
            "bytes_per_block": c.bytes_per_block, "bytes_per_block_mib": c.bytes_per_block_mib,
            "num_blocks": c.num_blocks, "block_tokens": c.block_tokens,
            "pages_per_request": c.pages_per_request,
            "requests_at_context": c.requests_at_context,
        }
        out["admission"] = admission(spec, context=p.context_tokens, new_tokens=new_tokens,
                                     prefix=prefix, available_bytes=c.available_bytes,
                                     workspace=workspace, dcp_size=dcp_size)
    return out


def admission(spec: Any, *, context: int, new_tokens: int, prefix: int, available_bytes: int,
              workspace: Any = None, dcp_size: int = 1) -> dict[str, Any]:
    """`request_budget` as plain data (the ``admission`` object of --json)."""
    from kvhandoff.kv_layout.admission import request_budget

    b = request_budget(spec, seq_len=context, new_tokens=new_tokens,
                       decode_prefix_len=min(prefix, context), available_bytes=available_bytes,
                       workspace=workspace, dcp_size=dcp_size)
    return {"prompt_tokens": context, "new_tokens": new_tokens,
            "cached_tokens": b.need.held_pages * b.need.page_size_tokens,
            "pages": b.need.pages, "prompt_pages": b.need.prompt_pages,
            "lines": [{"name": x.name, "bytes": x.nbytes, "detail": x.detail} for x in b.lines],
            "total_bytes": b.total_bytes, "prompt_only_bytes": b.prompt_only_bytes,
            "available_bytes": b.available_bytes, "admitted": b.admitted, "reason": b.reason}


def _measured_applies(spec: Any, p: Any) -> bool:
    return bool(spec.model == "glm-5.3" and p.context_tokens == 1_048_576
                and not spec.draft_layer_ids)


def _print_accounts(con: Any, a: dict[str, Any]) -> None:
    rules = a["page_rules"]
    if rules["problems"]:
        con.print("[bold red]page rules broken (an agent refuses to start):[/] "
                  + "; ".join(rules["problems"]))
    elif rules["rules"]:
        con.print("page rules hold: " + "; ".join(rules["rules"]))
    links = a["link"]
    lo, hi = MEASURED_S
    con.print("handoff at realistic link efficiency: " + ", ".join(
        f"{x['efficiency'] * 100:g} % ({x['bytes_per_s'] / 1e9:g} GB/s) {x['transfer_s']:.3f} s"
        for x in links) + (f"; measured {lo:g}-{hi:g} s = {a['measured_over_ideal'][0]:.1f}-"
                           f"{a['measured_over_ideal'][1]:.1f}x the ideal"
                           if a["measured_over_ideal"] else ""))
    t = a["ttft_tail"]
    at = ", ".join(f"{x['s'] * 1e3:.2f} ms at {x['efficiency'] * 100:g} %"
                   for x in t["last_layer_s_at"])
    floor = (f" = {t['floor_s']:.4f} s" if t["floor_s"] is not None else "")
    con.print(f"TTFT tail: last layer {t['last_layer']} ({', '.join(t['regions'])}) "
              f"{_fmt_bytes(t['last_layer_bytes'])} takes {t['last_layer_s'] * 1e3:.2f} ms "
              f"ideal ({at}); TTFT >= T_prefill + {t['last_layer_s'] * 1e3:.2f} ms + "
              f"T_first_decode_step" + (f" = {t['prefill_s']:g} s + "
                                        f"{t['last_layer_s'] * 1e3:.2f} ms + "
                                        f"{t['first_step_s']:g} s{floor}"
                                        if t["floor_s"] is not None else ""))
    c = a.get("capacity")
    if c is not None:
        con.print(f"admission capacity of {_fmt_bytes(c['available_bytes'])}: SGLang "
                  f"max_total_num_tokens = available // cell_size ({c['cell_size']:,} B) = "
                  f"{c['max_total_num_tokens']:,} tokens; vLLM num_blocks = available // "
                  f"bytes_per_block ({c['bytes_per_block']:,} B = "
                  f"{c['bytes_per_block_mib']:.2f} MiB) = {c['num_blocks']:,} blocks "
                  f"({c['block_tokens']:,} tokens); a request of the context needs "
                  f"{c['pages_per_request']:,} blocks: {c['requests_at_context']:,} fit")
    adm = a.get("admission")
    if adm is not None:
        con.print(f"admission of one request: {adm['prompt_tokens']:,} prompt + "
                  f"{adm['new_tokens']:,} new tokens ({adm['cached_tokens']:,} cached): "
                  f"{adm['pages']:,} pages")
        for x in adm["lines"]:
            con.print(f"  {x['name']}: {_fmt_bytes(x['bytes'])} ({x['detail']})")
        con.print(f"  total {_fmt_bytes(adm['total_bytes'])} of "
                  f"{_fmt_bytes(adm['available_bytes'])}: "
                  + ("admitted" if adm["admitted"] else f"[bold red]refused[/]: {adm['reason']}"))
    w = a["tail_waste"]
    con.print(f"tail-page waste: on average {w['avg_tokens']:g} tokens x cell = "
              f"{w['per_request_bytes'] / 1e6:.2f} MB per request; {w['requests']:,} requests "
              f"{w['total_bytes'] / 1e9:.2f} GB")


def _fmt_bytes(n: float) -> str:
    from kvhandoff.kv_layout import GB, GIB

    return f"{int(n):,} B ({n / GB:,.3f} GB = {n / GIB:,.3f} GiB)"


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        model: str = typer.Option("glm-5.3", help="Layout preset: glm-5.3, deepseek-v3.2, "
                                  "llama-3.1-8b."),
        context: int = typer.Option(1_048_576, help="Context length in tokens."),
        link_gbps: float = typer.Option(3200.0, help="Link rate in Gbit/s (3200 = 400 GB/s)."),
        page_size: int | None = typer.Option(None, help="Page size in tokens (default: the "
                                             "preset's)."),
        indexer_layers: int | None = typer.Option(None, help="Number of full indexer layers "
                                                  "(MLA presets; default: the model's)."),
        prefix: int = typer.Option(0, help="Tokens decode already holds (suffix-only regions "
                                   "are sent from this point, page-aligned down)."),
        prefill_tp: int | None = typer.Option(None, help="Prefill TP size: plan the pair (rank "
                                              "map, descriptors, bytes per rank)."),
        decode_tp: int | None = typer.Option(None, help="Decode TP size (pair plan)."),
        prefill_page: int | None = typer.Option(None, help="Prefill page size in tokens (pair "
                                                "plan; default: --page-size or the preset's)."),
        decode_page: int | None = typer.Option(None, help="Decode page size in tokens (pair "
                                               "plan; default: --page-size or the preset's)."),
        link_efficiency: list[float] = typer.Option(
            DEFAULT_EFFICIENCY, help="Fraction of line rate a transfer of 64-token pages "
            "reaches (repeatable; default 0.6 and 0.8)."),
        memory_gb: float | None = typer.Option(None, help="KV memory of one decode rank in GB "
                                               "(1e9 B): admission capacity."),
        requests: int = typer.Option(1000, help="Concurrent requests for the tail-page waste."),
        new_tokens: int = typer.Option(256, help="Tokens the request generates (admission with "
                                       "--memory-gb: prompt + these, rounded to pages)."),
        max_batched_tokens: int = typer.Option(8192, help="The engine's max_num_batched_tokens "
                                               "(the indexer's top-k index buffer)."),
        index_topk: int = typer.Option(2048, help="The indexer's top-k (its index buffer)."),
        decode_rows: int = typer.Option(1, help="Query rows of one decode step in the "
                                        "indexer's logits (1 + MTP draft tokens)."),
        dcp_size: int = typer.Option(1, help="Decode context parallel size (only 1: DCP is not "
                                     "modelled and refused)."),
        prefill_s: float | None = typer.Option(None, help="Prefill time in s (TTFT floor)."),
        first_step_s: float | None = typer.Option(None, help="First decode step in s (TTFT "
                                                  "floor)."),
        as_json: bool = typer.Option(False, "--json", help="Print a machine-readable object."),
    ) -> None:
        """Byte account per region (per token, page, context, layer) and ideal transfer times."""
        from rich.console import Console
        from rich.table import Table

        from kvhandoff.errors import KVHandoffError
        from kvhandoff.kv_layout import handoff_bytes, plan, preset

        try:
            effs = tuple(link_efficiency) or tuple(DEFAULT_EFFICIENCY)
            kwargs: dict[str, int | None] = {"page_size_tokens": page_size}
            if model != "llama-3.1-8b":
                kwargs["indexer_layers"] = indexer_layers
            spec = preset(model, **kwargs)
            p = plan(spec, context_tokens=context, link_gbps=link_gbps)
            moved = handoff_bytes(spec, seq_len=context, decode_prefix_len=min(prefix, context))
            pair = None
            if any(v is not None for v in (prefill_tp, decode_tp, prefill_page, decode_page)):
                pair = pair_plan(
                    model, context=context, prefix=prefix, prefill_tp=prefill_tp or 1,
                    decode_tp=decode_tp or 1, prefill_page=prefill_page or page_size,
                    decode_page=decode_page or page_size,
                    indexer_layers=indexer_layers if model != "llama-3.1-8b" else None)
            from kvhandoff.kv_layout.admission import IndexerWorkspace

            acc = accounts(spec, p, efficiencies=effs, memory_gb=memory_gb, requests=requests,
                           prefix=prefix, prefill_s=prefill_s, first_step_s=first_step_s,
                           new_tokens=new_tokens, dcp_size=dcp_size,
                           workspace=IndexerWorkspace(max_batched_tokens, index_topk,
                                                      decode_rows))
        except KVHandoffError as e:
            raise typer.BadParameter(str(e)) from e
        if as_json:
            d = p.to_dict()
            d["handoff_bytes"] = moved
            d["handoff_prefix_tokens"] = prefix
            d.update(acc)
            if pair is not None:
                d["pair"] = pair
            typer.echo(json.dumps(d, indent=2))
            return
        con = Console()
        t = Table(title=f"{model}: {context:,} tokens, page {p.page_size_tokens}, "
                  f"{p.pages:,} pages, link {link_gbps:g} Gbit/s "
                  f"({p.link_bytes_per_s / 1e9:g} GB/s)")
        for col in ("region", "layers", "B/token/layer", "B/token", "B/page", "context",
                    "one layer", "time (ideal)", "time/layer"):
            t.add_column(col, justify="right" if col != "region" else "left")
        for r in p.regions:
            t.add_row(r.name + (" (suffix-only)" if r.suffix_only else ""), str(r.layers),
                      f"{r.bytes_per_token_layer:,}", f"{r.bytes_per_token:,}",
                      f"{r.bytes_per_page:,}", _fmt_bytes(r.bytes_per_context),
                      f"{r.bytes_per_layer:,} B", f"{r.transfer_s * 1e3:.2f} ms",
                      f"{r.layer_transfer_s * 1e3:.3f} ms")
        t.add_row("total", "", "", f"{p.bytes_per_token:,}", f"{p.bytes_per_page:,}",
                  _fmt_bytes(p.bytes_per_context), "", f"{p.transfer_s:.4f} s", "")
        con.print(t)
        con.print(f"decode step reads: indexer {_fmt_bytes(p.indexer_read_bytes)} vs top-"
                  f"{p.top_k} sparse KV {_fmt_bytes(p.sparse_read_bytes)}")
        if prefix:
            total = sum(moved.values())
            con.print(f"handoff with a {prefix:,}-token decode prefix: "
                      + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in moved.items())
                      + f"; total {_fmt_bytes(total)}")
        _print_accounts(con, acc)
        if pair is not None:
            _print_pair(con, pair)
