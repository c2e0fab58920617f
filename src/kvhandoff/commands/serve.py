"""`kvhandoff serve`: run the bootstrap server (uvicorn).

Each flag overrides one `Settings` field; a flag left out keeps the value from the
``KVHANDOFF_<FIELD>`` environment variable, or the default. The listening socket is bound
before uvicorn starts, so ``--port 0`` works: the first line printed is
``kvhandoff bootstrap server listening on http://HOST:PORT``.

Logging: uvicorn's access lines go to stdout at log level ``info``, except for the answers of
SGLang's hot ``GET /route`` lookup, which get one only when they are errors unless
``--route-access-log`` (`bootstrap_server.access_log`); uvicorn's and kvhandoff's own messages
(start-up, a warning per request slower than ``--slow-request-s``, errors) go to stderr in
uvicorn's format.
"""

from __future__ import annotations

import logging
from typing import Any

import typer

from kvhandoff.errors import ConfigError
from kvhandoff.settings import Settings, listener_auth


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
        route_access_log: bool | None = typer.Option(
            None, "--route-access-log/--no-route-access-log", help=_help("route_access_log")),
        slow_request_s: float | None = typer.Option(None, help=_help("slow_request_s")),
        require_rdma: bool | None = typer.Option(
            None, "--require-rdma/--allow-tcp", help=_help("require_rdma")),
    ) -> None:
        """Run the bootstrap server: ranks register, rooms are assigned, decode asks where its
        prefill is. Native API under /v1, SGLang-compatible /route, /register_dp_rank,
        /query_dp_ranks; /health, /ready, /metrics; OpenAPI at /docs."""
        import uvicorn
        from pydantic import ValidationError

        from kvhandoff.bootstrap_server import access_log
        from kvhandoff.bootstrap_server.app import create_app
        from kvhandoff.bootstrap_server.fastpath import http_protocol
        from kvhandoff.bootstrap_server.sockets import bind_socket, socket_url
        from kvhandoff.netaddr import join_host_port

        given: dict[str, Any] = {
            "host": host, "port": port, "auth_token": auth_token, "rank_ttl_s": rank_ttl_s,
            "max_body_bytes": max_body_bytes, "room_retention_s": room_retention_s,
            "log_level": log_level, "require_rdma": require_rdma,
            "route_access_log": route_access_log, "slow_request_s": slow_request_s,
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
        try:  # before binding: create_app refuses the same, but with a traceback
            listener_auth(settings, what="bootstrap server", host_setting="host",
                          secret_setting="auth_token", warn=False)
        except ConfigError as e:
            raise typer.BadParameter(str(e)) from None
        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as e:
            where = join_host_port(settings.host, settings.port)
            raise typer.BadParameter(f"host/port: cannot listen on {where}: {e}") from e
        typer.echo(f"kvhandoff bootstrap server listening on {socket_url(sock)}", err=False)
        # http_protocol(): SGLang's GET /route answered at the HTTP parser (fastpath)
        config = uvicorn.Config(create_app(settings), log_level=level, lifespan="off",
                                http=http_protocol())
        # after uvicorn configured its loggers: GET /route answers stay out of the access log
        # unless route_access_log (errors and slow requests are logged either way)
        access_log.install(access_log.AccessPolicy.from_settings(settings))
        # kvhandoff's own warnings and errors (slow requests, a 500) in uvicorn's format
        ours = logging.getLogger("kvhandoff")
        for handler in logging.getLogger("uvicorn").handlers:
            ours.addHandler(handler)
        ours.setLevel(level.upper())
        ours.propagate = False
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])  # uvicorn's event loop choice: uvloop when installed
        finally:
            sock.close()
