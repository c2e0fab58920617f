"""`kvhandoff serve`: run the bootstrap server (uvicorn).

Each flag overrides one `Settings` field; a flag left out keeps the value from the
``KVHANDOFF_<FIELD>`` environment variable, or the default. The listening socket is bound
before uvicorn starts, so ``--port 0`` works: the first line printed is
``kvhandoff bootstrap server listening on http://HOST:PORT``.
"""

from __future__ import annotations

from typing import Any

import typer

from kvhandoff.settings import Settings


def _help(name: str) -> str:
    field = Settings.model_fields[name]
    env = f"KVHANDOFF_{name.upper()}"
    # no square brackets: typer's rich help would eat them as markup
    return f"{field.description} (env {env}; default {field.default!r})"


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_cmd(
        host: str | None = typer.Option(None, help=_help("host")),
        port: int | None = typer.Option(None, min=0, max=65535, help=_help("port")),
        auth_token: str | None = typer.Option(
            None, help=_help("auth_token") + " Prefer the env var: flags show in `ps`."),
        rank_ttl_s: float | None = typer.Option(None, help=_help("rank_ttl_s")),
        max_body_bytes: int | None = typer.Option(None, help=_help("max_body_bytes")),
        room_retention_s: float | None = typer.Option(None, help=_help("room_retention_s")),
        log_level: str | None = typer.Option(None, help=_help("log_level")),
        require_rdma: bool | None = typer.Option(
            None, "--require-rdma/--allow-tcp", help=_help("require_rdma")),
    ) -> None:
        """Run the bootstrap server: ranks register, rooms are assigned, decode asks where its
        prefill is. Native API under /v1, SGLang-compatible /route, /register_dp_rank,
        /query_dp_ranks; /health, /ready, /metrics; OpenAPI at /docs."""
        import uvicorn
        from pydantic import ValidationError

        from kvhandoff.bootstrap_server.app import create_app
        from kvhandoff.bootstrap_server.fastpath import http_protocol
        from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url

        given: dict[str, Any] = {
            "host": host, "port": port, "auth_token": auth_token, "rank_ttl_s": rank_ttl_s,
            "max_body_bytes": max_body_bytes, "room_retention_s": room_retention_s,
            "log_level": log_level, "require_rdma": require_rdma,
        }
        try:
            settings = Settings(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise typer.BadParameter(bad) from e
        level = settings.log_level.lower()
        if level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise typer.BadParameter(f"log_level: expected debug, info, warning or error, "
                                     f"got {settings.log_level!r}")
        if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.auth_token is None:
            typer.echo(f"warning: serving on {settings.host} without an auth token "
                       "(set KVHANDOFF_AUTH_TOKEN)", err=True)
        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as e:
            raise typer.BadParameter(f"host/port: cannot listen on "
                                     f"{settings.host}:{settings.port}: {e}") from e
        typer.echo(f"kvhandoff bootstrap server listening on {socket_url(sock)}", err=False)
        # http_protocol(): SGLang's GET /route answered at the HTTP parser (fastpath)
        config = uvicorn.Config(create_app(settings), log_level=level, lifespan="off",
                                http=http_protocol())
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])  # uvicorn's event loop choice: uvloop when installed
        finally:
            sock.close()
