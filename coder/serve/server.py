"""An OpenAI-compatible chat-completions server over coder's continuous-batching engine.

    server = Server(engine, tokenizer, model_name="coder", log=TrajectoryLog(url))
    uvicorn.run(server.app, host=..., port=...)        # stage serve: coder/stages/serve.py

Endpoints (JSON in and out; errors are OpenAI's `{"error": {"message", "type", "param",
"code"}}` with a 4xx status for a malformed request, and the server keeps serving):
- `POST /v1/chat/completions`: `messages`, `tools` (function schemas), `tool_choice` ("auto" |
  "none"), `stream` (+ `stream_options.include_usage`), `temperature`, `top_p`, `top_k`,
  `max_tokens` / `max_completion_tokens`, `stop`, `n`, `seed`, `logprobs`, `user`,
  `metadata.conversation_id`.
- `POST /v1/feedback`: `{completion_id | conversation_id, choice?, signal, value}`, a signal of
  `coder.rl.realtime.SIGNALS`; stored beside the trajectories. The server also derives
  `dissatisfied_followup` and `edit_kept` itself from the next request of a conversation (its
  user message; `metadata.workspace`, the client's file hashes; the context it sends):
  coder.serve.derived_signals.
- `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (with the engine's policy version; a
  server following a weight store adds its `weights`, EngineFollower.health, and says
  `"status": "degraded"` while the store's reads fail: it serves the version it holds).

**The prompt** is rendered exactly as SFT and RL render theirs: with `tools`, the system turn is
`coder.env.protocol.render_system_prompt(tools, preamble)` (the request's first system message is
the preamble; else `system_prompt`, else the protocol's default), built from `protocol.ToolSpec`s
of the request's function schemas; every turn is the tokenizer's `turn_ids(role, text)`, then
`generation_prefix()`. Consecutive `tool` messages form one tool turn, one
`<tool_result>...</tool_result>` per message (`tool_message_ids`, as SFT and RL); an assistant
message's `tool_calls` are written back as `protocol.render_tool_call` text. User and tool text
is encoded as plain text (a message holding "<|end|>" cannot forge a control token).

**The reply.** The engine samples until `<|end|>` (or eos, `max_tokens`, the context). With tools,
the text is parsed by `protocol.parse_tool_calls`: well-formed calls come back in `tool_calls`
(`finish_reason` "tool_calls") and the text outside them in `content`; if any call is malformed
the whole reply comes back as `content` and the log records it as broken. `stop` strings cut the
reply: the row is cancelled at the engine's next decode call (its `on_tokens` check), and the
log keeps the sampled ids up to the one that completed the stop string. `stream: true` sends
OpenAI's `chat.completion.chunk` events as the engine's decode calls produce tokens (text that
may still turn out to be a tool call or a stop string is held back) and the tool calls at the
end.

**Batching.** Each request's blocking engine calls run in a thread pool, so concurrent requests
decode together in the engine's batches (continuous batching). An engine built with
`speculative_k` (stage serve's `serve.speculative_k`) drafts with the MTP modules and verifies:
nothing here changes (the same tokens at temperature 0, the same distribution otherwise; a
decode call's `on_tokens` just brings up to k + 1 tokens per step).

**Logging** (`log`: a coder.serve.trajectory_log.TrajectoryLog): one record per choice with the
exact prompt and sampled ids, logprobs, policy version per token and routing (see that module).
The conversation id is the request's `metadata.conversation_id` or `X-Conversation-Id` header,
else derived from the client and the conversation's first system and user messages (so every
turn of one conversation shares it); it is returned as `conversation_id` and in the
`X-Conversation-Id` header. No header, key or message text is logged.

**Weights** (`coder.rl.weight_channel.EngineFollower`): a thread polls the weight store (coder.rl.weight_sync) and hands
each new version to `engine.set_weights(state, version)`: it applies between two decode calls,
requests in flight keep their caches, and every token records the version that sampled it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coder.env import protocol
from coder.infer.engine import SamplingParams
from coder.rl import realtime
from coder.rl.weight_channel import EngineFollower
from coder.serve.derived_signals import DerivedSignals

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4
KEYS = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "temperature", "top_p", "top_k",
        "max_tokens", "max_completion_tokens", "stop", "n", "seed", "logprobs", "user", "metadata"}
IGNORED = {"parallel_tool_calls", "store", "service_tier"}  # accepted; they change nothing here
# accepted only at their neutral value (anything else is a 400 naming the parameter)
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": 0,
            "response_format": None}


class APIError(Exception):
    """An OpenAI-format error with an HTTP status (4xx: the client's request is at fault)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, kind=self.kind)


def error_response(status: int, message: str, *, param=None, code=None, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


@dataclasses.dataclass
class ChatRequest:
    """A validated chat-completion request, rendered to the engine's prompt ids."""

    prompt_ids: list
    tools: dict  # name -> protocol.ToolSpec ({} = no tool parsing)
    n: int
    params: SamplingParams
    stop: list
    stream: bool
    include_usage: bool
    logprobs: bool
    seed: int | None
    conversation_id: str
    client_id: str
    request_id: str
    completion_id: str = ""


@dataclasses.dataclass
class Choice:
    """One choice's result: what the client gets and what the log records."""

    index: int
    tokens: list  # sampled ids kept (cut after a stop string)
    logprobs: list
    versions: list
    experts: np.ndarray  # [prompt + kept tokens, moe_layers, top_k]
    engine_finish: str  # stop | length | max_len
    text: str  # the reply's text (no end token; cut at a stop string)
    content: str | None
    tool_calls: list  # OpenAI tool_call dicts
    broken: list  # protocol.BrokenToolCall
    finish_reason: str  # OpenAI's: stop | length | tool_calls


# --- request parsing -----------------------------------------------------------------------------
def _text_of(content, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                               "supported", param=f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise APIError(f"{where}.content must be a string, null or a list of text parts", param=f"{where}.content")


def tool_specs(tools) -> dict:
    """The request's `tools` (OpenAI function schemas) as protocol.ToolSpecs by name."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise APIError("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    specs = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                           "'parameters'}}", param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}].function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema of type object",
                           param=f"tools[{i}].function.parameters")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise APIError(f"tools[{i}].function.description must be a string", param=f"tools[{i}].function.description")
        if name in specs:
            raise APIError(f"tools: {name!r} is defined twice", param="tools")
        specs[name] = protocol.ToolSpec(name, desc, params)
    return specs


def _assistant_text(m: dict, i: int) -> str:
    """An assistant message's text with its tool calls written back as protocol text."""
    text = _text_of(m.get("content"), f"messages[{i}]")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where)
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise APIError(f"{where}.function.arguments is not valid JSON: {e.msg}", param=where) from None
        if not isinstance(args, dict):
            raise APIError(f"{where}.function.arguments must be a JSON object", param=where)
        text += protocol.render_tool_call(fn["name"], args)
    return text


def render_prompt(tok, messages, tools: dict, preamble: str | None) -> list[int]:
    """The engine's prompt ids of a conversation (module docstring, "The prompt")."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(f"messages[{i}] must be an object whose role is one of {sorted(ROLES)}",
                           param=f"messages[{i}].role")
    ids: list[int] = []
    rest = list(enumerate(messages))
    if tools:
        first = ""
        if ROLES[messages[0]["role"]] == "system":
            first = _text_of(messages[0].get("content"), "messages[0]")
            rest = rest[1:]
        system = protocol.render_system_prompt(list(tools.values()), first or preamble or None)
        ids += tok.turn_ids("system", system)
    results: list[str] = []
    for k, (i, m) in enumerate(rest):
        role = ROLES[m["role"]]
        if role == "tool":
            results.append(_text_of(m.get("content"), f"messages[{i}]"))
            if k + 1 < len(rest) and ROLES[rest[k + 1][1]["role"]] == "tool":
                continue
            ids += tok.tool_message_ids(results)  # one tool turn per run of tool messages, as SFT and RL
            results = []
        elif role == "assistant":
            ids += tok.turn_ids("assistant", _assistant_text(m, i))
        elif role == "user":
            ids += [tok.special_id("user")] + tok.encode(_text_of(m.get("content"), f"messages[{i}]"),
                                                          allow_special=False) + [tok.end_id]
        else:
            ids += tok.turn_ids("system", _text_of(m.get("content"), f"messages[{i}]"))
    return ids + tok.generation_prefix()


def _number(body, key, lo, hi, default, *, integer=False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise APIError(f"{key} must be {kind} in [{lo}, {hi}], got {v!r}", param=key)
    return v


def _short(value, limit=256) -> str:
    """A client-given identifier, printable and bounded."""
    s = "".join(ch for ch in str(value) if ch.isprintable())
    return s[:limit]


def conversation_key(client_id: str, messages: list) -> str:
    """A conversation id derived from the client and the first system and user messages."""
    head = []
    for role in ("system", "user"):
        m = next((m for m in messages if ROLES.get(m.get("role")) == role), None)
        if m is not None:
            head.append(role + "\0" + _text_of(m.get("content"), "message"))
    h = hashlib.sha256("\0\0".join([client_id] + head).encode()).hexdigest()
    return f"conv-{h[:24]}"


# --- stop strings and streaming text --------------------------------------------------------------
def _first_stop(text: str, stops: list) -> int:
    """Index of the earliest stop string in `text` (-1: none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def _held_suffix(text: str, prefixes: list) -> int:
    """Length of the longest end of `text` that begins one of `prefixes` (it may still complete it)."""
    best = 0
    for p in prefixes:
        for k in range(min(len(p), len(text)), 0, -1):
            if text.endswith(p[:k]):
                best = max(best, k)
                break
    return best


def stop_watch(decode, stops: list, n: int, gone: threading.Event | None = None):
    """The engine's `on_tokens` check of one request (`n` rows): True (cancel the row) once the
    row's text holds one of `stops` or the client went away (`gone` set). It decodes only the
    row's tail that can hold a new stop string: a character takes at most 4 byte tokens."""
    ids = [[] for _ in range(n)]
    tail = 4 * max((len(s) for s in stops), default=0)

    def check(row: int, tokens) -> bool:
        if gone is not None and gone.is_set():
            return True
        if not stops:
            return False
        ids[row] += tokens
        return _first_stop(decode(ids[row][-(tail + len(tokens)):]), stops) >= 0

    return check


class Server:
    """The FastAPI app over one engine (module docstring). `app` is the ASGI application.

    Args:
      engine: a coder.infer.engine.Engine (thread-safe `start_group` / `generate`).
      tokenizer: the model's tokenizer (its chat template renders the prompt).
      model_name: the id of `/v1/models`; a request naming another model gets a 404.
      log: a TrajectoryLog (None: nothing logged, feedback refused).
      max_tokens: the default `max_tokens`.
      system_prompt: the system prompt's preamble when a request with tools has no system message.
      signals: the feedback signals accepted (default: every signal of coder.rl.realtime).
      seed: the server's sampling key (a request's `seed` replaces it).
      workers: threads running blocking engine calls (requests decoding at once, at most).
      clock: the wall clock stamping the log's completion and feedback records (unix seconds;
        the realtime stage's windows are cut on it; tests move it, as the stage's `clock`).
    """

    def __init__(self, engine, tokenizer, *, model_name: str = "coder", log=None, max_tokens: int = 512,
                 system_prompt: str = "", signals=None, seed: int = 0, workers: int = 64,
                 clock=time.time):
        self.engine, self.tok, self.model_name, self.log, self.clock = engine, tokenizer, model_name, log, clock
        self.max_tokens, self.preamble = int(max_tokens), system_prompt or None
        self.signals = sorted(realtime.SIGNALS if signals is None else signals)
        self.max_len = int(engine.max_len)
        self.max_n = int(engine.sched.pool.max_slots)
        ids = {tokenizer.end_id, getattr(tokenizer, "eos_id", None)}
        self.stop_ids = tuple(sorted(int(i) for i in ids if i is not None and i >= 0))
        self._key = jax.random.key(int(seed))
        self._count = 0
        self._count_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="serve")
        self.created = int(time.time())
        self.follower = None
        self.derived = DerivedSignals()  # each conversation's last completion, for the next request's signals
        self.app = self._build_app()

    # ------------------------------------------------------------------ the app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="coder", docs_url=None, redoc_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc):  # 404 / 405 of unknown routes, as OpenAI errors
            return error_response(exc.status_code, str(exc.detail), code=str(exc.status_code))

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            return exc.response()

        @app.exception_handler(Exception)
        async def server_error(request, exc: Exception):  # the engine failed: a 500, still OpenAI's format
            logging.error("request %s failed: %r", request.url.path, exc)
            return error_response(500, f"server error: {exc}", kind="server_error")

        @app.get("/health")
        async def health():
            out = {"status": "ok", "model": self.model_name, "policy_version": int(self.engine.policy_version)}
            if self.follower is not None:  # the weight store it follows: "degraded" while its reads fail
                out["weights"] = self.follower.health()
                out["status"] = "degraded" if out["weights"].get("failures") else "ok"
            return out

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.model_name:
                raise APIError(f"the model {model_id!r} does not exist; this server serves {self.model_name!r}",
                               param="model", code="model_not_found", status=404)
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await self._json(request)
            loop = asyncio.get_running_loop()  # tokenizing and the engine run in the pool, never here
            req = await loop.run_in_executor(self._pool, self._accept, body, request.headers)
            if req.stream:
                return StreamingResponse(self._stream(req), media_type="text/event-stream",
                                         headers={"X-Conversation-Id": req.conversation_id})
            choices = await loop.run_in_executor(self._pool, self._generate, req, None)
            return JSONResponse(self._response(req, choices), headers={"X-Conversation-Id": req.conversation_id})

        @app.post("/v1/feedback")
        async def feedback(request: Request):
            body = await self._json(request)
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.feedback, body, request.headers)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "coder",
                "max_model_len": self.max_len}

    @staticmethod
    async def _json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        return body

    # ------------------------------------------------------------------ requests
    def _accept(self, body: dict, headers) -> ChatRequest:
        """`parse`, then log what the request says about the conversation's last completion here
        (coder.serve.derived_signals)."""
        req = self.parse(body, headers)
        if self.log is not None:
            now = self.clock()
            for s in self.derived.observe(req.conversation_id, body.get("messages"), body.get("metadata") or {}):
                if s["signal"] in self.signals:
                    self.log.log_feedback({"time": now, "feedback_id": f"derived-{uuid.uuid4().hex}",
                                           "conversation_id": req.conversation_id, "client_id": req.client_id, **s})
        return req

    def parse(self, body: dict, headers) -> ChatRequest:
        """Validates a chat-completion body; APIError (4xx) naming the parameter otherwise."""
        unknown = sorted(set(body) - KEYS - IGNORED - set(_NEUTRAL))
        if unknown:
            raise APIError(f"unrecognized request argument(s): {unknown}", param=unknown[0])
        for key, neutral in _NEUTRAL.items():
            if body.get(key) not in (None, neutral, {}) and not (key == "response_format"
                                                                 and body[key] == {"type": "text"}):
                raise APIError(f"{key}={body[key]!r} is not supported by this server", param=key)
        if "model" in body and body["model"] != self.model_name:
            raise APIError(f"the model {body['model']!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", status=404)
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise APIError(f"tool_choice={choice!r} is not supported (use 'auto' or 'none')", param="tool_choice")
        tools = tool_specs(body.get("tools"))
        if choice == "none":
            tools = {}
        messages = body.get("messages")
        prompt = render_prompt(self.tok, messages, tools, self.preamble)
        if len(prompt) >= self.max_len:
            raise APIError(f"this model's maximum context length is {self.max_len} tokens; the messages hold "
                           f"{len(prompt)} (with the reply's first token: {len(prompt) + 1})",
                           param="messages", code="context_length_exceeded")
        temperature = float(_number(body, "temperature", 0.0, 2.0, 1.0))
        top_p = float(_number(body, "top_p", 0.0, 1.0, 1.0))
        if top_p <= 0:
            raise APIError("top_p must be > 0", param="top_p")
        top_k = int(_number(body, "top_k", 0, 1 << 30, 0, integer=True))
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int(_number(body, key, 1, 1 << 30, self.max_tokens, integer=True))
        max_tokens = min(max_tokens, self.max_len - len(prompt))
        n = int(_number(body, "n", 1, self.max_n, 1, integer=True))
        seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, None, integer=True)
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if (not isinstance(stop, list) or len(stop) > MAX_STOP
                or not all(isinstance(s, str) and s for s in stop)):
            raise APIError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError("stream must be a boolean", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError("stream_options must be an object", param="stream_options")
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool) or (logprobs and stream):
            raise APIError("logprobs must be a boolean, and is supported without stream only", param="logprobs")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise APIError("metadata must be an object", param="metadata")
        client = _short(body.get("user") or headers.get("x-client-id") or "")
        conversation = _short(meta.get("conversation_id") or headers.get("x-conversation-id") or "", 128)
        conversation = conversation or conversation_key(client, messages)
        request_id = _short(headers.get("x-request-id") or "", 128) or f"req-{uuid.uuid4().hex}"
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_tokens,
                                stop_token_ids=self.stop_ids)
        return ChatRequest(prompt, tools, n, params, stop, stream, bool(options.get("include_usage")),
                           logprobs, seed, conversation, client, request_id)

    def _rng(self, seed):
        if seed is not None:
            return jax.random.key(int(seed) % (1 << 32))
        with self._count_lock:
            self._count += 1
            count = self._count
        return jax.random.fold_in(self._key, count)

    # ------------------------------------------------------------------ generation (a pool thread)
    def _generate(self, req: ChatRequest, on_tokens, completion_id: str | None = None) -> list:
        """Blocks on the engine; returns the Choices and logs them."""
        completion_id = completion_id or f"chatcmpl-{uuid.uuid4().hex}"
        req.completion_id = completion_id
        try:
            group = self.engine.start_group(req.prompt_ids, req.n)
        except ValueError as e:  # a prompt the engine cannot hold
            raise APIError(str(e), param="messages", code="context_length_exceeded") from None
        try:
            if on_tokens is None and req.stop:  # the engine stops a row once its stop string appears
                watch = stop_watch(self.decode, req.stop, req.n)
                on_tokens = lambda row, tokens, logprobs: watch(row, tokens)  # noqa: E731
            gens = self.engine.generate(group, req.params, self._rng(req.seed), on_tokens=on_tokens)
            experts = [group.expert_ids(i) for i in range(req.n)]
        finally:
            group.close()
        choices = [self._choice(i, g, e, req) for i, (g, e) in enumerate(zip(gens, experts))]
        if self.log is not None:
            now = self.clock()
            for c in choices:
                self.log.log_completion(self._record(req, c, now))
            self.derived.remember(req.conversation_id, completion_id, [(c.content, c.tool_calls) for c in choices])
        return choices

    def decode(self, ids) -> str:
        """Text of sampled ids (ids past the tokenizer's vocabulary, the embedding's padding, have none)."""
        v = self.tok.vocab_size
        return self.tok.decode([i for i in ids if i < v and i not in self.stop_ids])

    def _choice(self, index: int, gen, experts: np.ndarray, req: ChatRequest) -> Choice:
        tokens, logprobs, versions = list(gen.tokens), list(gen.logprobs), list(gen.policy_version)
        text = self.decode(tokens)
        finish = gen.finish_reason
        cut = _first_stop(text, req.stop) if req.stop else -1
        if cut >= 0:  # the fewest ids whose text holds the stop string
            lo, hi = 1, len(tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                if _first_stop(self.decode(tokens[:mid]), req.stop) >= 0:
                    hi = mid
                else:
                    lo = mid + 1
            tokens, logprobs, versions = tokens[:lo], logprobs[:lo], versions[:lo]
            experts = experts[:len(req.prompt_ids) + lo]
            text, finish = text[:cut], "stop"
        calls, broken = [], []
        if req.tools and (protocol.CALL_OPEN in text or protocol.CALL_CLOSE in text):
            for item in protocol.parse_tool_calls(text, req.tools):
                (calls if isinstance(item, protocol.ToolCall) else broken).append(item)
        content, tool_calls, reason = text, [], "length" if finish in ("length", "max_len") else "stop"
        if calls and not broken:
            for c in calls:
                content = content.replace(c.text, "", 1)
            tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                          for c in calls]
            reason = "tool_calls" if reason == "stop" else reason
        if tool_calls and not content.strip():
            content = None
        return Choice(index, tokens, logprobs, versions, experts, finish, text, content, tool_calls, broken, reason)

    def _record(self, req: ChatRequest, c: Choice, now: float) -> dict:
        experts = np.ascontiguousarray(c.experts)
        p = req.params
        return {
            "time": now, "request_id": req.request_id, "completion_id": req.completion_id, "choice": c.index,
            "conversation_id": req.conversation_id, "client_id": req.client_id, "model": self.model_name,
            "prompt_ids": list(req.prompt_ids), "completion_ids": c.tokens,
            "logprobs": [float(x) for x in c.logprobs], "versions": [int(v) for v in c.versions],
            "policy_version": int(c.versions[0]) if c.versions else int(self.engine.policy_version),
            "expert_ids": experts.tobytes(), "expert_dtype": str(experts.dtype),
            "moe_layers": int(experts.shape[1]) if experts.ndim == 3 else 0,
            "top_k": int(experts.shape[2]) if experts.ndim == 3 else 0,
            "temperature": float(p.temperature), "top_p": float(p.top_p), "sampling_top_k": int(p.top_k),
            "max_tokens": int(p.max_new_tokens), "finish_reason": c.engine_finish,
            "tool_calls": len(c.tool_calls), "broken_calls": len(c.broken),
            "broken_reason": c.broken[0].reason if c.broken else "", "stream": bool(req.stream),
        }

    # ------------------------------------------------------------------ responses
    def _usage(self, req: ChatRequest, choices) -> dict:
        completion = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(req.prompt_ids) + completion}

    def _message(self, c: Choice) -> dict:
        msg = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            msg["tool_calls"] = c.tool_calls
        return msg

    def _response(self, req: ChatRequest, choices: list) -> dict:
        out = []
        for c in choices:
            item = {"index": c.index, "message": self._message(c), "finish_reason": c.finish_reason,
                    "logprobs": None}
            if req.logprobs:
                item["logprobs"] = {"content": [
                    {"token": (piece := self.decode([t])), "logprob": float(lp), "bytes": list(piece.encode()),
                     "top_logprobs": []} for t, lp in zip(c.tokens, c.logprobs)]}
            out.append(item)
        return {"id": req.completion_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": out, "usage": self._usage(req, choices),
                "conversation_id": req.conversation_id, "system_fingerprint": f"v{self.engine.policy_version}"}

    def _chunk(self, req, choices: list, usage=None) -> str:
        body = {"id": req.completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "conversation_id": req.conversation_id}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def _stream(self, req: ChatRequest):
        """Server-sent events: a role chunk, content deltas as the engine decodes, tool calls and
        the finish reason at the end, `[DONE]`."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req.completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        ids = [[] for _ in range(req.n)]
        sent = [""] * req.n
        held = [p for p in req.stop] + ([protocol.CALL_OPEN] if req.tools else [])

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody reads the stream
                pass

        gone = threading.Event()  # the client disconnected: the engine drops the rows
        watch = stop_watch(self.decode, req.stop, req.n, gone)

        def on_tokens(row, tokens, logprobs):  # the engine's thread: quick, and never raises
            put(("tokens", row, list(tokens)))
            return watch(row, tokens)

        def run():
            try:
                result = ("done", self._generate(req, on_tokens, req.completion_id))
            except BaseException as e:  # noqa: BLE001 - reported in the stream
                result = ("error", e)
            put(result)

        def live_text(row) -> str:
            text = self.decode(ids[row])
            cut = _first_stop(text, req.stop) if req.stop else -1
            if cut >= 0:
                return text[:cut]
            if req.tools and protocol.CALL_OPEN in text:
                return text[:text.index(protocol.CALL_OPEN)]
            text = text[:len(text) - _held_suffix(text, held)]
            return text.rstrip("\ufffd")  # an incomplete UTF-8 character waits for its next bytes

        self._pool.submit(run)
        try:
            async for chunk in self._stream_chunks(req, queue, ids, sent, live_text):
                yield chunk
        finally:  # normal end, or the client went away (the ASGI server cancels this generator)
            gone.set()

    async def _stream_chunks(self, req: ChatRequest, queue, ids, sent, live_text):
        yield self._chunk(req, [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                                for i in range(req.n)])
        while True:
            kind, *rest = await queue.get()
            if kind == "tokens":
                row, tokens = rest
                ids[row] += tokens
                text = live_text(row)
                if text.startswith(sent[row]) and len(text) > len(sent[row]):
                    delta, sent[row] = text[len(sent[row]):], text
                    yield self._chunk(req, [{"index": row, "delta": {"content": delta}, "finish_reason": None}])
            elif kind == "error":
                e = rest[0]
                status, message = (e.status, e.message) if isinstance(e, APIError) else (500, f"engine error: {e}")
                logging.error("stream %s failed: %s", req.request_id, message)
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': status}})}\n\n"
                break
            else:
                for c in rest[0]:
                    delta = {}
                    content = c.content or ""
                    if content.startswith(sent[c.index]) and len(content) > len(sent[c.index]):
                        delta["content"] = content[len(sent[c.index]):]
                    if c.tool_calls:
                        delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(c.tool_calls)]
                    yield self._chunk(req, [{"index": c.index, "delta": delta, "finish_reason": c.finish_reason}])
                if req.include_usage:
                    yield self._chunk(req, [], usage=self._usage(req, rest[0]))
                break
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ feedback
    def feedback(self, body: dict, headers) -> JSONResponse:
        """Records one user signal about a completion or a conversation."""
        if self.log is None:
            raise APIError("feedback is not recorded: this server has no trajectory log (serve.log_store)",
                           status=503, kind="server_error")
        known = {"completion_id", "conversation_id", "choice", "signal", "value", "user"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise APIError(f"unrecognized feedback argument(s): {unknown}; expected {sorted(known)}", param=unknown[0])
        cid, conv = body.get("completion_id") or "", body.get("conversation_id") or ""
        if not isinstance(cid, str) or not isinstance(conv, str) or not (cid or conv):
            raise APIError("feedback needs completion_id or conversation_id (strings)", param="completion_id")
        signal = body.get("signal")
        if signal not in self.signals:
            raise APIError(f"unknown signal {signal!r}; signals are {self.signals}", param="signal")
        value = body.get("value")
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise APIError("value must be a finite number (or a boolean)", param="value")
        choice = _number(body, "choice", -1, self.max_n - 1, -1, integer=True)
        record = {"time": self.clock(), "feedback_id": f"fb-{uuid.uuid4().hex}", "completion_id": _short(cid, 128),
                  "conversation_id": _short(conv, 128), "choice": int(choice), "signal": signal, "value": float(value),
                  "client_id": _short(body.get("user") or headers.get("x-client-id") or "")}
        self.log.log_feedback(record)
        return JSONResponse({"id": record["feedback_id"], "object": "feedback", "completion_id": cid or None,
                             "conversation_id": conv or None, "signal": signal, "value": float(value)})

    # ------------------------------------------------------------------ weights and shutdown
    def follow(self, url: str, template, poll_seconds: float = 10.0):
        """Follow the weight store at `url` (a thread: coder.rl.weight_channel.EngineFollower);
        `template` is the model's nnx.State."""

        self.follower = EngineFollower(self.engine, url, template)
        self.follower.start(poll_seconds)
        return self.follower

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
        self._pool.shutdown(wait=True)
        if self.log is not None:
            self.log.close()
