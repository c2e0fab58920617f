#!/usr/bin/env python3
"""kvhandoff-probe: exit 0 when a route of the bootstrap server answers 2xx, else 1.

For Docker HEALTHCHECK and compose healthchecks, where no HTTP client is on the image's PATH
(Kubernetes uses its own httpGet probes instead). Standard library only, so it starts fast.

    kvhandoff-probe /health                 # alive
    kvhandoff-probe /ready                  # every expected rank registered and live
    kvhandoff-probe --url http://bootstrap:8998 /ready

The default URL is http://127.0.0.1:$KVHANDOFF_PORT (8998 when unset): the same variable the
server reads, so the probe follows a port change.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

DEFAULT_PORT = "8998"


def default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('KVHANDOFF_PORT') or DEFAULT_PORT}"


def probe(url: str, path: str, *, timeout_s: float) -> tuple[bool, str]:
    """GET url+path. Returns (ok, one line saying what came back)."""
    target = url.rstrip("/") + "/" + path.lstrip("/")
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            body = resp.read(300).decode("utf-8", "replace")
            return 200 <= resp.status < 300, f"{target}: {resp.status} {body}"
    except urllib.error.HTTPError as e:
        body = e.read(300).decode("utf-8", "replace")
        return False, f"{target}: {e.code} {body}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{target}: unreachable: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvhandoff-probe", description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default="/health", help="route to GET (default /health)")
    ap.add_argument("--url", default=None, help="server base URL (default %(default)s: "
                    "http://127.0.0.1:$KVHANDOFF_PORT)")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = ap.parse_args(argv)
    ok, line = probe(args.url or default_url(), args.path, timeout_s=args.timeout)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
