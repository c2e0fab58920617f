"""`kvhandoff route`: the disaggregated-serving router for vLLM engines running
KVHandoffConnector (the HTTP API of vLLM's disaggregated-serving proxy example, plus drain);
`kvhandoff drain`: move a decode's running requests to the other decodes.

`kvhandoff.integrations.vllm.router` has the API and how a request moves."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    @app.command("route")
    def route_cmd(
        prefill: str = typer.Option(..., help="The prefill engine's URL (vllm serve with "
                                    "KVHandoffConnector, kv_role kv_producer)."),
        decode: list[str] = typer.Option(..., help="A decode engine's URL (kv_role "
                                         "kv_consumer); repeat for each decode."),
        host: str = typer.Option("127.0.0.1", help="Address to listen on."),
        port: int = typer.Option(8000, min=0, max=65535, help="Port (0: any free port)."),
        on_lost: str = typer.Option(
            "recompute", help="When a request's decode goes away and the prefill cannot offer "
            "its prompt's pages again: recompute (the next decode computes prompt and "
            "generated tokens) or fail (the stream ends with an error event). Both counted "
            "in GET /status."),
        timeout_s: float = typer.Option(600.0, help="HTTP timeout towards the engines."),
        move: str = typer.Option(
            "resume", help="How a request moves: resume (the prefill offers the prompt's pages "
            "again, the next decode computes only the generated tokens) or replay (the next "
            "decode computes prompt and generated tokens: the comparison baseline)."),
    ) -> None:
        """Route completions prefill -> decode as vLLM's disaggregated proxy does
        (POST /v1/completions, POST /v1/chat/completions), and keep them alive when their
        decode leaves: POST /drain {"decode": URL} moves each request streaming from it to
        another decode (the prefill offers the prompt's pages again, the new decode computes
        only the tokens already generated; the client's stream continues with nothing lost or
        repeated); a decode whose stream breaks (killed, crashed) has its requests moved the
        same way. POST /undrain, GET /routes (requests in flight), GET /status (decodes and
        counters). The router applies each request's stop strings to its whole stream, across
        moves."""
        import asyncio

        import httpx
        import uvicorn

        from kvhandoff.bootstrap_server.sockets import bind_socket
        from kvhandoff.integrations.vllm.router import MOVES, ON_LOST, Router, make_app

        if on_lost not in ON_LOST:
            raise typer.BadParameter(f"--on-lost: expected one of {ON_LOST}, got {on_lost!r}")
        if move not in MOVES:
            raise typer.BadParameter(f"--move: expected one of {MOVES}, got {move!r}")
        sock = bind_socket(host, port)

        async def serve() -> None:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                router = Router(prefill, decode, client, on_lost=on_lost, move=move)
                config = uvicorn.Config(make_app(router), log_level="info")
                server = uvicorn.Server(config)
                typer.echo(f"kvhandoff router listening on http://{host}:"
                           f"{sock.getsockname()[1]}", err=False)
                await server.serve(sockets=[sock])

        asyncio.run(serve())

    @app.command("drain")
    def drain_cmd(
        decode: str = typer.Argument(..., help="The decode engine's URL, as given to "
                                     "`kvhandoff route --decode`."),
        router: str = typer.Option("http://127.0.0.1:8000", help="The router's URL."),
        undo: bool = typer.Option(False, "--undo", help="Let the decode take new requests "
                                  "again (POST /undrain)."),
        timeout_s: float = typer.Option(600.0, help="How long to wait for the moves."),
    ) -> None:
        """Move every request streaming from DECODE to the router's other decodes (POST
        /drain); prints each moved request's drain time and the gap its client saw. DECODE
        takes no new request until `kvhandoff drain --undo DECODE`."""
        import httpx

        path = "/undrain" if undo else "/drain"
        try:
            r = httpx.post(f"{router.rstrip('/')}{path}", json={"decode": decode},
                           timeout=timeout_s)
        except httpx.HTTPError as e:
            typer.echo(f"router {router}: {type(e).__name__}: {e}", err=True)
            raise typer.Exit(2) from e
        typer.echo(json.dumps(r.json(), indent=2))
        if r.status_code != 200:
            raise typer.Exit(1)
