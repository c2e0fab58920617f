"""`kvhandoff verify`: an output-level canary for a running prefill/decode pair.

Checksums prove that the bytes moved are the bytes planned; only the engine's output proves
that the plan matches where the kernels keep a token. This command sends a few probe prompts
two ways and compares what comes back:

- **pair**: the proxy flow (the prefill with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true}``, then the decode with the
  ``kv_transfer_params`` the prefill returned): the decode generates from the KV it was handed;
- **alone**: the same prompt on the prefill engine by itself (a request without
  ``kv_transfer_params`` is computed like on any engine).

Greedy sampling, ``logprobs=1``, token ids (``return_tokens_as_token_ids``). Each probe is one
prompt of an exact token count (the probe text tokenized by the prefill's ``/tokenize``, cut to
length, a different rotation per prompt so probes share no prefix): choose lengths that give a
full, a partial and a one-token last page for the block sizes in use. Each path uses its own
fresh ``cache_salt``, so neither path hits a prefix cached by the other or by an earlier run:
the decode really loads every probe.

Verdict PASS when every probe generates the same tokens on both paths with logprobs within
``--tolerance`` nats, and the decode's ``vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}`` grew by at least the prompt tokens the pair should have moved (all
but the last token of each prompt): a decode that computed the prompts itself (a failed load
under ``kv_load_failure_policy=recompute``) gives the right tokens but proves nothing. The
time to first token of both paths is printed per probe (pair: prefill request + the decode's
first streamed token). Exit code 0 PASS, 1 FAIL, 2 the check could not run.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import typer

PROBE_TEXT = (
    "A prefill engine computes the prompt; a decode engine generates the answer from the KV "
    "cache it was handed. Pages move layer by layer while the next layers compute, and every "
    "byte that lands is checked. The quick brown fox jumps over the lazy dog 0123456789 times, "
    "then counts the pages again: one, two, three, four, five, six, seven, eight, nine, ten. "
)
DEFAULT_LENGTHS = "33,40,64,65"  # one-token (16, 32), partial (16, 32, 64), full, one-token (64)
EXTERNAL = "external_kv_transfer"


class VerifyError(Exception):
    """The check could not run (an engine unreachable, an answer that is not a completion)."""


@dataclass
class Completion:
    """What one path generated for one prompt."""

    tokens: list[str]
    logprobs: list[float]
    ttft_s: float


@dataclass
class Probe:
    """One prompt through both paths."""

    prompt_tokens: int
    tokens_equal: bool
    first_mismatch: int | None  # index of the first differing generated token
    max_abs_diff_nats: float  # over the common prefix of generated tokens
    first_token_diff_nats: float
    ttft_alone_s: float
    ttft_pair_s: float
    alone: list[str] = field(repr=False)
    pair: list[str] = field(repr=False)


@dataclass
class Report:
    model: str
    tolerance_nats: float
    probes: list[Probe]
    external_tokens_moved: int | None  # decode metric delta; None: /metrics not readable
    external_tokens_expected: int
    verdict: str  # "PASS" | "FAIL"
    reasons: list[str]


def _post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise VerifyError(f"POST {url}: HTTP {r.status_code}: {r.text[:300]}")
    out: dict[str, Any] = r.json()
    return out


def stream_completion(client: Any, base: str, body: dict[str, Any]) -> Completion:
    """POST a streaming /v1/completions; collect tokens, logprobs and the time to the first
    token (from the request's start)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens: list[str] = []
    logprobs: list[float] = []
    with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise VerifyError(f"POST {base}/v1/completions: HTTP {r.status_code}: "
                              f"{r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise VerifyError(f"{base}: error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                lp = choice.get("logprobs") or {}
                got = lp.get("tokens") or []
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += got
                logprobs += [float(x) for x in lp.get("token_logprobs") or []]
    if ttft is None or len(tokens) != len(logprobs):
        raise VerifyError(f"{base}: the stream carried no tokens with logprobs")
    return Completion(tokens=tokens, logprobs=logprobs, ttft_s=ttft)


def remote_prefill(client: Any, prefill: str, body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's first step: the prompt on the prefill, one token, ``do_remote_decode``;
    returns the ``kv_transfer_params`` to hand the decode."""
    resp = _post(client, f"{prefill}/v1/completions",
                 {**body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    params = resp.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise VerifyError(f"{prefill}: the prefill returned no kv_transfer_params (is it a "
                          f"kv_producer with KVHandoffConnector, known to its bootstrap server?)")
    return params


def pair_completion(client: Any, prefill: str, decode: str, body: dict[str, Any]
                    ) -> Completion:
    """The proxy flow: prefill (one token, ``do_remote_decode``), then the decode with the
    returned ``kv_transfer_params``; TTFT counts both requests."""
    t0 = time.perf_counter()
    params = remote_prefill(client, prefill, body)
    prefill_s = time.perf_counter() - t0
    out = stream_completion(client, decode, {**body, "kv_transfer_params": params})
    out.ttft_s += prefill_s
    return out


def external_tokens(client: Any, decode: str) -> int | None:
    """The decode's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``
    summed over engines; None when /metrics does not answer or lacks it."""
    try:
        r = client.get(f"{decode}/metrics")
    except Exception:  # noqa: BLE001 - a missing metric is reported as "not checked"
        return None
    if r.status_code != 200:
        return None
    total, seen = 0.0, False
    for line in r.text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and \
                f'source="{EXTERNAL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return int(total) if seen else None


def served_model(client: Any, base: str) -> str:
    r = client.get(f"{base}/v1/models")
    if r.status_code != 200:
        raise VerifyError(f"GET {base}/v1/models: HTTP {r.status_code}")
    data = r.json().get("data") or []
    if not data:
        raise VerifyError(f"{base}: /v1/models lists no model")
    return str(data[0]["id"])


def probe_prompts(client: Any, prefill: str, model: str, lengths: list[int]) -> list[list[int]]:
    """One token-id prompt per length: the probe text tokenized by the prefill's tokenizer,
    repeated to length, each prompt starting at another offset (no shared prefix)."""
    resp = _post(client, f"{prefill}/tokenize",
                 {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False})
    ids = [int(t) for t in resp.get("tokens") or []]
    if len(ids) < 8:
        raise VerifyError(f"{prefill}/tokenize: the probe text gave {len(ids)} tokens")
    prompts = []
    for i, n in enumerate(lengths):
        start = (7 * i + 1) % len(ids)
        rot = ids[start:] + ids[:start]
        prompts.append((rot * (n // len(rot) + 1))[:n])
    return prompts


def compare(n: int, alone: Completion, pair: Completion) -> Probe:
    common = 0
    while (common < min(len(alone.tokens), len(pair.tokens))
           and alone.tokens[common] == pair.tokens[common]):
        common += 1
    equal = alone.tokens == pair.tokens
    # logprobs compared where both generated the same context (up to and incl. the first
    # differing token: its logprob is still conditioned on the same prefix)
    upto = min(common + 1, len(alone.logprobs), len(pair.logprobs))
    diffs = [abs(a - b) for a, b in zip(alone.logprobs[:upto], pair.logprobs[:upto], strict=True)]
    return Probe(prompt_tokens=n, tokens_equal=equal, first_mismatch=None if equal else common,
                 max_abs_diff_nats=max(diffs, default=0.0),
                 first_token_diff_nats=diffs[0] if diffs else 0.0,
                 ttft_alone_s=alone.ttft_s, ttft_pair_s=pair.ttft_s,
                 alone=alone.tokens, pair=pair.tokens)


def run_verify(*, prefill: str, decode: str, model: str | None = None,
               lengths: list[int], max_tokens: int = 12, tolerance_nats: float = 1e-3,
               timeout_s: float = 120.0) -> Report:
    """Send the probes through the pair and the prefill alone; compare (see the module doc)."""
    import httpx

    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        try:
            name = model or served_model(client, prefill)
            prompts = probe_prompts(client, prefill, name, lengths)
            before = external_tokens(client, decode)
            salt = uuid.uuid4().hex
            probes = []
            for i, prompt in enumerate(prompts):
                body = {"model": name, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True,
                        "ignore_eos": True}
                alone = stream_completion(client, prefill,
                                          {**body, "cache_salt": f"alone-{salt}-{i}"})
                pair = pair_completion(client, prefill, decode,
                                       {**body, "cache_salt": f"pair-{salt}-{i}"})
                probes.append(compare(len(prompt), alone, pair))
            after = external_tokens(client, decode)
        except httpx.HTTPError as e:
            raise VerifyError(f"{type(e).__name__}: {e}") from e
    moved = None if before is None or after is None else after - before
    expected = sum(n - 1 for n in lengths)
    reasons = []
    for p in probes:
        if not p.tokens_equal:
            reasons.append(f"{p.prompt_tokens}-token prompt: generated token "
                           f"{p.first_mismatch} differs (alone {p.alone[p.first_mismatch or 0]!r}, "
                           f"pair {p.pair[p.first_mismatch or 0]!r})")
        if p.max_abs_diff_nats > tolerance_nats:
            reasons.append(f"{p.prompt_tokens}-token prompt: logprobs differ by "
                           f"{p.max_abs_diff_nats:.3g} nats (tolerance {tolerance_nats:g})")
    if moved is not None and moved < expected:
        reasons.append(f"the decode loaded {moved} prompt tokens from the prefill, expected at "
                       f"least {expected}: it computed (some) prompts itself, so the pair's KV "
                       f"was not checked (a failed load recomputed? see the decode's log)")
    return Report(model=name, tolerance_nats=tolerance_nats, probes=probes,
                  external_tokens_moved=moved, external_tokens_expected=expected,
                  verdict="FAIL" if reasons else "PASS", reasons=reasons)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _print(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvhandoff verify: {report.model}")
    for col in ("prompt tokens", "tokens", "max |Δ logprob| (nats)", "first token Δ",
                "TTFT alone (ms)", "TTFT pair (ms)"):
        table.add_column(col, justify="right")
    for p in report.probes:
        table.add_row(str(p.prompt_tokens),
                      "equal" if p.tokens_equal else f"[red]differ at {p.first_mismatch}[/]",
                      f"{p.max_abs_diff_nats:.3g}", f"{p.first_token_diff_nats:.3g}",
                      f"{p.ttft_alone_s * 1e3:.1f}", f"{p.ttft_pair_s * 1e3:.1f}")
    console = Console()
    console.print(table)
    moved = ("not readable" if report.external_tokens_moved is None
             else str(report.external_tokens_moved))
    console.print(f"decode loaded {moved} prompt tokens from the prefill "
                  f"(expected >= {report.external_tokens_expected})")
    console.print(f"TTFT median: alone {_median([p.ttft_alone_s for p in report.probes]) * 1e3:.1f}"
                  f" ms, pair {_median([p.ttft_pair_s for p in report.probes]) * 1e3:.1f} ms")
    for r in report.reasons:
        console.print(f"  - {r}", markup=False)
    style = "bold green" if report.verdict == "PASS" else "bold red"
    console.print(f"[{style}]verdict: {report.verdict}[/]")


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token counts, got {text!r}") from None
    if not out or min(out) < 2:
        raise typer.BadParameter(f"every prompt needs at least 2 tokens, got {text!r}")
    return out


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify_cmd(
        prefill: str = typer.Option(..., help="The prefill engine's base URL (a vLLM "
                                    "kv_producer), e.g. http://10.0.0.1:8100."),
        decode: str = typer.Option(..., help="The decode engine's base URL (a vLLM "
                                   "kv_consumer), e.g. http://10.0.0.2:8200."),
        model: str | None = typer.Option(None, help="Model name in the requests (default: the "
                                         "first one the prefill's /v1/models lists)."),
        lengths: str = typer.Option(DEFAULT_LENGTHS, help="Prompt lengths in tokens, comma-"
                                    "separated; pick a full, a partial and a one-token last "
                                    "page for your block sizes."),
        max_tokens: int = typer.Option(12, min=1, help="Tokens generated per probe (greedy)."),
        tolerance: float = typer.Option(
            1e-3, min=0.0, help="Largest |logprob difference| in nats that still passes. 0 "
            "asks for bit-equal logprobs (deterministic kernels, same TP on both sides: the CPU "
            "build's GQA). Pairs of another TP size differ by their all-reduce order (~2e-6 on "
            "the CPU build); MLA decodes the last prompt token on another kernel (CPU build: up "
            "to ~5e-3; use 1e-2 with --max-tokens 1, a near-tie may flip a later token)."),
        timeout_s: float = typer.Option(120.0, min=0.1, help="Bound on each HTTP request."),
        as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    ) -> None:
        """Check a running prefill/decode pair end to end: probe prompts through the pair (the
        proxy flow) and through the prefill alone must generate the same tokens with the same
        logprobs (greedy). Prints both paths' TTFT and a verdict. Exit 0 PASS, 1 FAIL (outputs
        disagree, or the decode did not load the KV), 2 the check could not run."""
        try:
            report = run_verify(prefill=prefill, decode=decode, model=model,
                                lengths=_lengths(lengths), max_tokens=max_tokens,
                                tolerance_nats=tolerance, timeout_s=timeout_s)
        except VerifyError as e:
            typer.echo(f"kvhandoff verify: could not run: {e}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(json.dumps(asdict(report), indent=2))
        else:
            _print(report)
        raise typer.Exit(0 if report.verdict == "PASS" else 1)
