"""`kvhandoff plan`: the capacity and transfer-time tables of a layout."""

from __future__ import annotations

import json

import typer


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
        as_json: bool = typer.Option(False, "--json", help="Print a machine-readable object."),
    ) -> None:
        """Byte account per region (per token, page, context, layer) and ideal transfer times."""
        from rich.console import Console
        from rich.table import Table

        from kvhandoff.errors import KVHandoffError
        from kvhandoff.kv_layout import handoff_bytes, plan, preset

        try:
            kwargs: dict[str, int | None] = {"page_size_tokens": page_size}
            if model != "llama-3.1-8b":
                kwargs["indexer_layers"] = indexer_layers
            spec = preset(model, **kwargs)
            p = plan(spec, context_tokens=context, link_gbps=link_gbps)
            moved = handoff_bytes(spec, seq_len=context, decode_prefix_len=min(prefix, context))
        except KVHandoffError as e:
            raise typer.BadParameter(str(e)) from e
        if as_json:
            d = p.to_dict()
            d["handoff_bytes"] = moved
            d["handoff_prefix_tokens"] = prefix
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
