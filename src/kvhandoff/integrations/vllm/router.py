"""`kvhandoff route`: the disaggregated-serving proxy flow for vLLM engines running
`KVHandoffConnector`, which keeps a request alive when its decode goes away.

HTTP API (the one vLLM's disaggregated-serving proxy example serves, plus the router's own):

- ``POST /v1/completions``: as vLLM's proxy flow: the request goes to the prefill with
  ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; then
  to a decode (round robin over the decodes that are up) with the ``kv_transfer_params`` the
  prefill returned. The answer is the decode's: an SSE stream when ``stream`` is set, else one
  JSON completion. One prompt per request, ``n=1``, no ``echo`` (refused with 400 naming the
  field). The router always asks the engines for token ids (``return_token_ids``); they reach
  the client only where it asked for them.
- ``POST /v1/chat/completions``: the same flow with vLLM's chat endpoint (the prefill's chat
  answer with ``max_tokens=1``, then the decode's chat stream). Chunks keep the chat format
  (``chat.completion.chunk``, ``delta.content``; ``chat.completion`` when not streaming) under
  one id, also after a move. ``n=1``; no ``tools``, ``logprobs``, ``response_format`` other
  than text, ``structured_outputs`` (400 naming the field): a moved request continues as a
  completion, which carries none of them.
- ``POST /drain`` ``{"decode": URL}``: the decode takes no new request, and each request
  streaming from it moves to another decode (below). Answers once each moved request has its
  first token from its new decode: ``{"decode", "moved", "requests": [{"id", "tokens_before",
  "to", "drain_s", "gap_s"}]}`` (tokens_before: the tokens the old decode gave the request,
  one it sent before the stop included; drain_s: from the stop to the first token on the new
  decode; gap_s: the client's time between the last token before the move and the first
  after; a request that ended on the old decode has no `to`).
- ``POST /undrain`` ``{"decode": URL}``: the decode takes new requests again (also one marked
  lost).
- ``GET /routes``: the requests in flight: id, decode, tokens so far, moves.
- ``GET /status``: each decode's state (``up``, ``draining``, ``lost``), the counters, and the
  last moves (``recent_moves``: id, why (``drain`` / ``lost``), from, to, tokens_before,
  drain_s, gap_s).

Moving a request (a drain, or a decode whose stream broke: killed, crashed, unreachable): the
client has received the tokens ``G`` of its prompt ``P`` (token ids; the router counts only
tokens it forwarded). The router asks the prefill again for ``P`` (its prefix cache still holds
the pages: vLLM computes the tokens of the last block only, and opens a new room over ``P``),
then sends the decode ``P + G`` with ``max_tokens`` less ``len(G)`` and those ``kv_transfer_params``
plus ``kvhandoff_resume: true``: the new decode loads ``P``'s pages and computes only ``G``'s,
then goes on; its tokens are spliced onto the client's stream (one completion id, nothing
lost, repeated or changed with greedy sampling). Where the prefill cannot offer the pages
(down, refused), ``on_lost`` decides: ``recompute`` sends ``P + G`` without
``kv_transfer_params`` (the decode computes all of it), ``fail`` ends the stream with an error
event; both are counted in ``/status``. A chat request moves the same way: the router asks the
prefill to render and tokenize its messages (vLLM's ``POST /tokenize`` with ``messages``: the
template is the engine's, never the router's), and the next decode gets a completion of that
prompt plus ``G``; its chunks are turned back into chat chunks.

Stop strings: the router, not the decodes, applies the request's ``stop`` to the whole text its
client gets (across moves): the decodes are sent no ``stop``, so none holds text back, and the
router holds back the last ``len(longest stop) - 1`` characters (as vLLM does) until they
cannot begin a stop string. Where one appears the stream ends with ``finish_reason: "stop"``
and ``stop_reason`` the string, nothing after it is forwarded (the string itself only with
``include_stop_str_in_output``), and the decode's request is closed (vLLM aborts it). As in
vLLM, stop strings count only once more than ``min_tokens`` tokens are generated.

Limits: seeded random sampling does not continue the engine's random stream (greedy does); a
moved chat request's text is the completion's, so a reasoning or tool parser on the decode
does not split it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("kvhandoff.route")

ON_LOST = ("recompute", "fail")
# resume: the prefill offers the prompt's pages again; replay: the next decode computes prompt
# and generated tokens (what a router without kvhandoff does; the baseline of the figures)
MOVES = ("resume", "replay")
ASK = {"do_remote_decode": True, "do_remote_prefill": False}
LAND_BOUND_S = 300.0
RECENT = 256  # moves kept for GET /status
# what a chat request's body carries over to the completion a moved chat request continues as
# (sampling and cache fields both endpoints take; `stop` is the router's own, below)
CHAT_TO_COMPLETION = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "length_penalty", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
    "allowed_token_ids", "bad_words", "priority", "cache_salt", "user", "vllm_xargs")
# what vLLM's /tokenize takes of a chat request to render its prompt as the chat endpoint does
TOKENIZE_CHAT = ("model", "messages", "add_generation_prompt", "continue_final_message",
                 "chat_template", "chat_template_kwargs", "add_special_tokens",
                 "mm_processor_kwargs")


class RouteError(Exception):
    """A request the router refuses (HTTP status, message naming the field)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Decode:
    url: str
    state: str = "up"  # up | draining | lost


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class StopText:
    """A request's stop strings over the whole text its client gets, fed piece by piece (the
    chunks of every decode it streams from, in order): what to forward now and the stop string
    found, by vLLM's rules (`vllm.v1.engine.detokenizer`): the stop string that ends first wins
    (ties: the list's order); only text after the first `min_tokens` tokens' may end one; the
    last `len(longest) - 1` characters are held back until they cannot begin one (none held
    with `include`, where the stop string itself is forwarded)."""

    def __init__(self, stop: Any, *, include: bool = False, min_tokens: int = 0) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stops = [x for x in stops if x]
        self.include = include
        self.min_tokens = min_tokens
        self.hold = 0 if include or not self.stops else max(map(len, self.stops)) - 1
        self.text = ""  # all the text so far: forwarded, then held back
        self.sent = 0  # characters forwarded
        self.check_from: int | None = None  # where text that may end a stop string begins

    def feed(self, text: str, n_tokens: int, final: bool) -> tuple[str, str | None]:
        """`text`: the next chunk's; `n_tokens`: the tokens generated so far, this chunk's
        included; `final`: the decode ended the request. Returns (forward now, stop string)."""
        before = len(self.text)
        self.text += text
        if self.stops and n_tokens > self.min_tokens:
            if self.check_from is None:  # this chunk holds the first token past min_tokens
                self.check_from = before
            lo = max(before, self.check_from)  # a stop string must end after `lo`
            best: tuple[int, int, str] | None = None
            for x in self.stops:
                i = self.text.find(x, max(lo + 1 - len(x), 0))
                if i >= 0 and (best is None or i + len(x) < best[0]):
                    best = (i + len(x), i, x)
            if best is not None:
                end, i, x = best
                cut = end if self.include else i
                out = self.text[self.sent:max(cut, self.sent)]
                self.sent = max(cut, self.sent)
                return out, x
        cut = len(self.text) if final else max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent:cut], cut
        return out, None


@dataclass
class Flight:
    """One request in flight: what the client has received, where it streams from."""

    id: str
    body: dict[str, Any]
    prompt: list[int]
    decode: Decode
    generated: list[int] = field(default_factory=list)
    moves: int = 0
    move: asyncio.Event = field(default_factory=asyncio.Event)
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    last_token_t: float = 0.0
    stop_t: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    chat: bool = False  # a /v1/chat/completions request
    rendered: bool = False  # chat: `prompt` is the prefill's /tokenize of the messages
    max_model_len: int | None = None
    stop: StopText = field(default_factory=lambda: StopText(None))

    @property
    def limit(self) -> int | None:
        """The request's max tokens (None: a chat request up to the model's length)."""
        if self.chat:
            out = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
            return int(out) if out is not None else None
        return int(self.body.get("max_tokens", 16))


class Router:
    def __init__(self, prefill: str, decodes: list[str], client: httpx.AsyncClient, *,
                 on_lost: str = "recompute", max_moves: int = 4, move: str = "resume"
                 ) -> None:
        if not decodes:
            raise ValueError("route: give at least one decode URL")
        if on_lost not in ON_LOST:
            raise ValueError(f"on_lost: expected one of {ON_LOST}, got {on_lost!r}")
        if move not in MOVES:
            raise ValueError(f"move: expected one of {MOVES}, got {move!r}")
        self.move = move
        self.prefill = prefill.rstrip("/")
        self.decodes = [Decode(u.rstrip("/")) for u in decodes]
        self.client = client
        self.on_lost = on_lost
        self.max_moves = max_moves
        self.flights: dict[str, Flight] = {}
        self.counters: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)  # the last moves
        self._rr = itertools.count()

    # ---- decodes

    def decode_of(self, url: str) -> Decode:
        for d in self.decodes:
            if d.url == url.rstrip("/"):
                return d
        raise RouteError(404, f"decode: {url!r} is not one of {[d.url for d in self.decodes]}")

    def pick(self, avoid: Decode | None = None) -> Decode | None:
        up = [d for d in self.decodes if d.state == "up" and d is not avoid]
        return up[next(self._rr) % len(up)] if up else None

    # ---- the prefill

    async def offer(self, body: dict[str, Any], prompt: Any) -> tuple[dict[str, Any],
                                                                       list[int]]:
        """The prefill computes (or finds in its prefix cache) `prompt` and opens a room over
        its pages: (kv_transfer_params, prompt token ids). Raises RouteError."""
        first = {**body, "prompt": prompt, "max_tokens": 1, "stream": False,
                 "return_token_ids": True, "kv_transfer_params": ASK}
        for k in ("min_tokens", "stream_options", "stop", "include_stop_str_in_output"):
            first.pop(k, None)
        out = await self._prefill_post("/v1/completions", first)
        params = out.get("kv_transfer_params")
        ids = (out.get("choices") or [{}])[0].get("prompt_token_ids")
        if not isinstance(params, dict):
            raise RouteError(502, f"prefill {self.prefill}: no kv_transfer_params in its answer "
                                  "(is it running KVHandoffConnector as kv_producer?)")
        if not isinstance(ids, list):
            raise RouteError(502, f"prefill {self.prefill}: no prompt_token_ids in its answer")
        return params, ids

    async def _prefill_post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await self.client.post(f"{self.prefill}{path}", json=body)
        except httpx.HTTPError as e:
            raise RouteError(502, f"prefill {self.prefill}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise RouteError(r.status_code, r.text)
        try:
            out = r.json()
        except json.JSONDecodeError as e:
            raise RouteError(502, f"prefill {self.prefill}{path}: not JSON: {e}") from e
        if not isinstance(out, dict):
            raise RouteError(502, f"prefill {self.prefill}{path}: not a JSON object")
        return out

    async def offer_chat(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The chat request's prefill (vLLM's chat endpoint, `max_tokens=1`):
        (kv_transfer_params, the rendered prompt's token ids, [] where the answer has none)."""
        first = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True,
                 "kv_transfer_params": ASK}
        for k in ("max_completion_tokens", "min_tokens", "stream_options", "stop",
                  "include_stop_str_in_output"):
            first.pop(k, None)
        out = await self._prefill_post("/v1/chat/completions", first)
        params = out.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise RouteError(502, f"prefill {self.prefill}: no kv_transfer_params in its answer "
                                  "(is it running KVHandoffConnector as kv_producer?)")
        ids = out.get("prompt_token_ids")
        return params, list(ids) if isinstance(ids, list) else []

    async def render(self, f: Flight) -> None:
        """A chat request's prompt as token ids, rendered by the prefill (vLLM's /tokenize with
        `messages`: its chat template, not ours); once per request. Raises RouteError."""
        if f.rendered:
            return
        ask = {k: f.body[k] for k in TOKENIZE_CHAT if k in f.body}
        out = await self._prefill_post("/tokenize", ask)
        ids, mml = out.get("tokens"), out.get("max_model_len")
        if not (isinstance(ids, list) and ids and all(_is_int(t) for t in ids)):
            raise RouteError(502, f"prefill {self.prefill}/tokenize: no tokens in its answer")
        if f.prompt and f.prompt != ids:
            raise RouteError(502, f"prefill {self.prefill}: /tokenize rendered the messages "
                                  f"as {len(ids)} tokens, its chat answer had "
                                  f"{len(f.prompt)} different ones")
        if f.limit is None and not _is_int(mml):
            raise RouteError(502, f"prefill {self.prefill}/tokenize: no max_model_len in its "
                                  "answer (the request has no max_tokens)")
        f.prompt, f.rendered = list(ids), True
        f.max_model_len = mml if isinstance(mml, int) else None

    # ---- a request

    @staticmethod
    def check(body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise RouteError(400, "prompt: one prompt (a string or a list of token ids)")
        if body.get("n", 1) != 1 or body.get("best_of", 1) not in (1, None):
            raise RouteError(400, "n/best_of: the router streams one completion per request")
        if body.get("echo"):
            raise RouteError(400, "echo: not supported through the router")
        mt = body.get("max_tokens", 16)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise RouteError(400, f"max_tokens: expected an integer >= 1, got {mt!r}")
        Router._check_common(body)

    @staticmethod
    def _check_common(body: dict[str, Any]) -> None:
        stop = body.get("stop")
        if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(
                isinstance(x, str) for x in stop))):
            raise RouteError(400, "stop: expected a string or a list of strings")
        mn = body.get("min_tokens", 0)
        if not _is_int(mn) or mn < 0:
            raise RouteError(400, f"min_tokens: expected an integer >= 0, got {mn!r}")

    @staticmethod
    def check_chat(body: dict[str, Any]) -> None:
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
            raise RouteError(400, "messages: a non-empty list of messages")
        for m in msgs:  # a moved request continues from token ids: no media would reach it
            parts = m.get("content")
            if isinstance(parts, list) and any(
                    not isinstance(p, dict) or p.get("type") != "text" for p in parts):
                raise RouteError(400, "messages: text content only through the router")
        if body.get("n", 1) != 1:
            raise RouteError(400, "n: the router streams one completion per request")
        for k in ("max_completion_tokens", "max_tokens"):
            mt = body.get(k)
            if mt is not None and (not _is_int(mt) or mt < 1):
                raise RouteError(400, f"{k}: expected an integer >= 1, got {mt!r}")
        # a moved chat request continues as a completion, which carries none of these
        if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
            raise RouteError(400, "tools/tool_choice: not supported through the router")
        if body.get("logprobs") or body.get("top_logprobs"):
            raise RouteError(400, "logprobs/top_logprobs: not supported for chat through the "
                                  "router")
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
            raise RouteError(400, "response_format: only {\"type\": \"text\"} through the "
                                  "router")
        if body.get("structured_outputs") is not None:
            raise RouteError(400, "structured_outputs: not supported through the router")
        if body.get("echo"):
            raise RouteError(400, "echo: not supported through the router")
        if body.get("include_reasoning") is False:  # vLLM then hides the chunks' token ids
            raise RouteError(400, "include_reasoning: false is not supported through the "
                                  "router (it needs every token id to move a request)")
        Router._check_common(body)

    async def start(self, body: dict[str, Any], *, chat: bool = False) -> Flight:
        if chat:
            self.check_chat(body)
            params, ids = await self.offer_chat(body)
        else:
            self.check(body)
            params, ids = await self.offer(body, body["prompt"])
        d = self.pick()
        if d is None:
            raise RouteError(503, "no decode is up (see GET /status)")
        f = Flight(id=f"{'chatcmpl' if chat else 'cmpl'}-route-{uuid.uuid4().hex}", body=body,
                   prompt=ids, decode=d, chat=chat,
                   stop=StopText(body.get("stop"),
                                 include=bool(body.get("include_stop_str_in_output")),
                                 min_tokens=int(body.get("min_tokens") or 0)))
        f.figures["params"] = params
        self.counters["requests"] += 1
        self.flights[f.id] = f
        return f

    def _completion_body(self, f: Flight) -> dict[str, Any]:
        """The request's body as a completion: a chat request's sampling fields only."""
        if not f.chat:
            return dict(f.body)
        return {k: f.body[k] for k in CHAT_TO_COMPLETION if k in f.body}

    def _decode_body(self, f: Flight, params: dict[str, Any] | None
                     ) -> tuple[str, dict[str, Any]]:
        """(path, body) for the flight's next decode. The decodes get no `stop`: the router
        applies it to the whole stream (a decode would hold text back and see its own only)."""
        k = len(f.generated)
        if f.chat and not f.moves:  # the chat's first decode: vLLM's chat endpoint
            path, b = "/v1/chat/completions", dict(f.body)
        else:
            path, b = "/v1/completions", self._completion_body(f)
            if k or f.chat:
                b["prompt"] = f.prompt + f.generated
                limit = f.limit
                if limit is None:  # a chat request without max tokens: up to the model's length
                    limit = (f.max_model_len or 0) - len(f.prompt)  # render() checked it
                b["max_tokens"] = limit - k
                if "min_tokens" in b:
                    b["min_tokens"] = max(0, int(b["min_tokens"]) - k)
        b.update(stream=True, return_token_ids=True)
        for x in ("stream_options", "stop", "include_stop_str_in_output",
                  "max_completion_tokens" if path == "/v1/completions" else ""):
            b.pop(x, None)
        if params is not None:
            b["kv_transfer_params"] = {**params, "kvhandoff_resume": True} if k else params
        else:
            b.pop("kv_transfer_params", None)
        return path, b

    async def chunks(self, f: Flight) -> AsyncIterator[dict[str, Any]]:
        """The completion's chunks as the client gets them, across moves."""
        params: dict[str, Any] | None = f.figures.pop("params")
        want_ids = bool(f.body.get("return_token_ids"))
        first_chunk = True
        # set once the flight has moved to another decode, until that decode's first token:
        # a token of the old decode read after the stop (a drain racing a chunk in flight) is
        # the client's all the same but not the landing
        landing = False
        try:
            while True:
                outcome = "done"
                try:
                    # aclosing: closed on a break too, so the old decode's request is aborted
                    # at once, not when the generator is collected
                    async with aclosing(self._one_decode(f, params)) as stream:
                        async for chunk in stream:
                            if "choices" not in chunk:  # the engine's error event: the end
                                yield chunk
                                return
                            ch = chunk["choices"][0]
                            toks = ch.get("token_ids") or []
                            f.generated.extend(toks)
                            chunk = self._client_chunk(f, chunk)
                            ch = chunk["choices"][0]
                            now = time.monotonic()
                            if toks and landing:
                                landing = False
                                f.figures.update(drain_s=now - f.stop_t,
                                                 gap_s=now - f.last_token_t, to=f.decode.url)
                                self.recent.append({
                                    "id": f.id, **{k: f.figures.get(k) for k in (
                                        "why", "from", "to", "tokens_before", "drain_s",
                                        "gap_s")}})
                                f.stop_t = 0.0
                                f.landed.set()
                            if toks:
                                f.last_token_t = now
                            chunk["id"] = f.id
                            if not want_ids:
                                ch.pop("token_ids", None)
                            if not want_ids or not first_chunk:
                                ch.pop("prompt_token_ids", None)
                                chunk.pop("prompt_token_ids", None)  # the chat endpoint's
                            first_chunk = False
                            yield chunk
                            if ch.get("finish_reason") is not None:
                                return
                            if f.move.is_set():
                                break
                        else:
                            outcome = "lost"  # the stream ended without a finish reason
                    if f.move.is_set():
                        outcome = "drain"
                except _Lost as e:
                    outcome = "drain" if f.move.is_set() else "lost"
                    if outcome == "lost":
                        log.warning("request %s: decode %s lost: %s", f.id, f.decode.url, e)
                if outcome == "done":
                    return
                # move the request: a drain, or a decode lost under it
                f.stop_t = f.stop_t or time.monotonic()
                f.figures.update(why=outcome, tokens_before=len(f.generated),
                                 **{"from": f.decode.url})
                if outcome == "lost":
                    f.decode.state = "lost"
                    self.counters["decodes_lost"] += 1
                f.move.clear()
                f.moves += 1
                if f.moves > self.max_moves:
                    yield _error(f"request moved {f.moves - 1} times; giving up")
                    return
                nxt = self.pick(avoid=f.decode)
                if nxt is None:
                    self.counters["moves_failed"] += 1
                    yield _error("the request's decode went away and no other decode is up")
                    return
                f.decode, landing = nxt, True
                if f.chat:  # its prompt as token ids: the next decode gets a completion
                    try:
                        await self.render(f)
                    except RouteError as e:
                        self.counters["moves_failed"] += 1
                        yield _error(f"the request's decode went away and the prefill cannot "
                                     f"render its messages: {e}")
                        return
                if self.move == "replay":
                    self.counters["moved_replayed"] += 1
                    params = None
                    continue
                try:
                    params, _ = await self.offer(self._completion_body(f), f.prompt)
                    self.counters[f"moved_{outcome}"] += 1
                except RouteError as e:
                    if self.on_lost == "fail":
                        self.counters["moves_failed"] += 1
                        yield _error(f"the request's decode went away and the prefill cannot "
                                     f"offer its prompt again: {e}")
                        return
                    log.warning("request %s: the prefill cannot offer the prompt again (%s); "
                                "the decode computes it (on_lost=recompute)", f.id, e)
                    self.counters["moved_recomputed"] += 1
                    params = None
        finally:
            f.landed.set()
            self.flights.pop(f.id, None)

    def _client_chunk(self, f: Flight, chunk: dict[str, Any]) -> dict[str, Any]:
        """A decode's chunk as the client gets it: its text through the request's stop strings
        (`Flight.stop`), in the client's format (a moved chat request's completion chunks become
        chat chunks)."""
        ch = chunk["choices"][0]
        upstream_chat = "delta" in ch
        delta = ch.get("delta") or {}
        text = (delta.get("content") if upstream_chat else ch.get("text")) or ""
        fin = ch.get("finish_reason")
        out, hit = f.stop.feed(text, len(f.generated), final=fin is not None)
        if hit is not None:
            ch["finish_reason"], ch["stop_reason"] = "stop", hit
        if not f.chat:
            ch["text"] = out
            return chunk
        if upstream_chat:
            if out or "content" in delta:
                ch["delta"] = {**delta, "content": out}
            return chunk
        c: dict[str, Any] = {"index": 0, "delta": {"content": out} if out or not ch.get(
            "finish_reason") else {}, "logprobs": None, "finish_reason": ch.get("finish_reason")}
        for k in ("stop_reason", "token_ids"):
            if k in ch:
                c[k] = ch[k]
        return {"id": f.id, "object": "chat.completion.chunk", "created": chunk.get("created"),
                "model": chunk.get("model"), "choices": [c]}

    async def _one_decode(self, f: Flight, params: dict[str, Any] | None
                          ) -> AsyncGenerator[dict[str, Any], None]:
        """One decode's stream, until it ends, breaks (`_Lost`) or the flight is moved."""
        path, body = self._decode_body(f, params)
        req = self.client.build_request("POST", f"{f.decode.url}{path}", json=body)
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise _Lost(f"{type(e).__name__}: {e}") from e
        try:
            if upstream.status_code != 200:
                text = (await upstream.aread()).decode(errors="replace")
                if upstream.status_code >= 500:
                    raise _Lost(f"HTTP {upstream.status_code}: {text[:200]}")
                yield {"error": {"message": text, "code": upstream.status_code}}
                return
            lines = upstream.aiter_lines()
            moved = asyncio.ensure_future(f.move.wait())
            try:
                while True:
                    nxt = asyncio.ensure_future(lines.__anext__())
                    await asyncio.wait({nxt, moved}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():  # moved: this decode's request is stopped (aborted)
                        nxt.cancel()
                        return
                    try:
                        line = nxt.result()
                    except StopAsyncIteration:
                        return
                    except httpx.HTTPError as e:
                        raise _Lost(f"{type(e).__name__}: {e}") from e
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "choices" not in data:  # vLLM's error event: the stream's end
                        yield data
                        return
                    yield data
            finally:
                moved.cancel()
        finally:
            await upstream.aclose()

    # ---- drain

    async def drain(self, url: str) -> dict[str, Any]:
        d = self.decode_of(url)
        if d.state == "up":
            d.state = "draining"
        moving = [f for f in self.flights.values() if f.decode is d]
        before = {f.id: len(f.generated) for f in moving}
        for f in moving:
            for k in ("to", "drain_s", "gap_s", "tokens_before"):  # an earlier move's
                f.figures.pop(k, None)
            f.landed.clear()
            f.stop_t = time.monotonic()
            f.move.set()
        self.counters["drains"] += 1
        await asyncio.wait_for(asyncio.gather(*(f.landed.wait() for f in moving)),
                               LAND_BOUND_S)
        rows = [{"id": f.id, "tokens_before": f.figures.get("tokens_before", before[f.id]),
                 "to": f.figures.get("to"),
                 "drain_s": f.figures.get("drain_s"), "gap_s": f.figures.get("gap_s")}
                for f in moving]
        return {"decode": d.url, "moved": sum(r["to"] is not None for r in rows),
                "requests": rows}

    def status(self) -> dict[str, Any]:
        return {"prefill": self.prefill,
                "decodes": [{"url": d.url, "state": d.state} for d in self.decodes],
                "on_lost": self.on_lost, "move": self.move, "counters": dict(self.counters),
                "in_flight": len(self.flights), "recent_moves": list(self.recent)}


class _Lost(Exception):
    """A decode's stream broke."""


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "kvhandoff_route"}}


def _sse(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _merged(chunks: list[dict[str, Any]], fid: str) -> dict[str, Any]:
    """A non-streaming client's completion from the chunks."""
    ch0: dict[str, Any] = {"index": 0, "text": "", "finish_reason": None, "logprobs": None}
    base: dict[str, Any] = {"id": fid, "object": "text_completion", "choices": [ch0]}
    for c in chunks:
        if "error" in c:
            return c
        ch = c["choices"][0]
        base.setdefault("model", c.get("model"))
        base.setdefault("created", c.get("created"))
        ch0["text"] += ch.get("text") or ""
        ch0["finish_reason"] = ch.get("finish_reason") or ch0["finish_reason"]
        ch0["stop_reason"] = ch.get("stop_reason")
        for k in ("token_ids", "prompt_token_ids"):
            if ch.get(k) is not None:
                ch0[k] = (ch0.get(k) or []) + list(ch[k])
        lp = ch.get("logprobs")
        if lp:
            if ch0["logprobs"] is None:
                ch0["logprobs"] = {k: [] for k in lp}
            for k, v in lp.items():
                ch0["logprobs"].setdefault(k, []).extend(v or [])
    return base


def _merged_chat(chunks: list[dict[str, Any]], fid: str) -> dict[str, Any]:
    """A non-streaming chat client's completion from the (chat) chunks."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    ch0: dict[str, Any] = {"index": 0, "message": msg, "logprobs": None, "finish_reason": None,
                           "stop_reason": None}
    base: dict[str, Any] = {"id": fid, "object": "chat.completion", "choices": [ch0]}
    for c in chunks:
        if "error" in c:
            return c
        base.setdefault("model", c.get("model"))
        base.setdefault("created", c.get("created"))
        if c.get("prompt_token_ids") is not None:
            base["prompt_token_ids"] = c["prompt_token_ids"]
        ch = c["choices"][0]
        msg["content"] += (ch.get("delta") or {}).get("content") or ""
        ch0["finish_reason"] = ch.get("finish_reason") or ch0["finish_reason"]
        ch0["stop_reason"] = ch.get("stop_reason")
        if ch.get("token_ids") is not None:
            ch0["token_ids"] = (ch0.get("token_ids") or []) + list(ch["token_ids"])
    return base


def make_app(router: Router) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def _complete(request: Request, *, chat: bool) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RouteError(400, "body: expected a JSON object")
            f = await router.start(body, chat=chat)
        except RouteError as e:
            return JSONResponse({"error": {"message": str(e)}}, e.status)
        except json.JSONDecodeError as e:
            return JSONResponse({"error": {"message": f"body: not JSON: {e}"}}, 400)
        if body.get("stream"):
            async def relay() -> AsyncIterator[bytes]:
                async for c in router.chunks(f):
                    yield _sse(c)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(relay(), media_type="text/event-stream")
        got = [c async for c in router.chunks(f)]
        out = _merged_chat(got, f.id) if chat else _merged(got, f.id)
        return JSONResponse(out, 502 if "error" in out else 200)

    async def drain(request: Request) -> Response:
        try:
            body = await request.json()
            out = await router.drain(str(body.get("decode", "")))
        except RouteError as e:
            return JSONResponse({"error": {"message": str(e)}}, e.status)
        except (json.JSONDecodeError, AttributeError):
            return JSONResponse({"error": {"message": 'body: expected {"decode": URL}'}}, 400)
        except TimeoutError:
            return JSONResponse({"error": {"message": "drain: the moved requests did not "
                                           f"resume within {LAND_BOUND_S} s"}}, 504)
        return JSONResponse(out)

    async def undrain(request: Request) -> Response:
        try:
            body = await request.json()
            d = router.decode_of(str(body.get("decode", "")))
        except RouteError as e:
            return JSONResponse({"error": {"message": str(e)}}, e.status)
        except (json.JSONDecodeError, AttributeError):
            return JSONResponse({"error": {"message": 'body: expected {"decode": URL}'}}, 400)
        d.state = "up"
        return JSONResponse(router.status())

    async def routes(request: Request) -> Response:
        return JSONResponse([{"id": f.id, "decode": f.decode.url, "tokens": len(f.generated),
                              "moves": f.moves} for f in router.flights.values()])

    async def status(request: Request) -> Response:
        return JSONResponse(router.status())

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/drain", drain, methods=["POST"]),
        Route("/undrain", undrain, methods=["POST"]),
        Route("/routes", routes, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
    ])
