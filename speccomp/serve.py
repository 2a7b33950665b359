"""`speccomp serve ENGINE_DIR`: an OpenAI-compatible HTTP server over an exported engine, batching continuously.

    speccomp serve engine/ --port 8000
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0}'

Endpoints (FastAPI on uvicorn): POST /v1/completions and POST /v1/chat/completions (OpenAI's request and response
shapes; "stream": true sends server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text: requests, tokens, target forwards, tokens per row step, throughput, running and waiting rows).
temperature 0 is greedy decoding (the engine's output is the model's own greedy text); > 0 samples losslessly.
Every choice carries its `token_ids` beside its `text`; an engine exported without a tokenizer takes prompts of token
ids only and answers with those ids and an empty `text`.

One thread owns the engine (`Scheduler`): between two steps of the running batch (speccomp/engine/runtime.py's
`EngineBatch`, which packs every row into one forward) it admits waiting requests while the batch has room for the
whole generation (prompt + max_tokens + the tree's room, in cache slots) and rows are fewer than --max-batch, and
removes rows that finished or whose client went away. The event loop only parses, queues and streams. A request that
could never fit, or with a bad parameter, is answered 400 with OpenAI's error body naming the parameter.
"""

import asyncio
import collections
import contextlib
import json
import os
import socket
import threading
import time
import uuid
import warnings

from speccomp.drafters.text_bridge import WINDOW, text_after
from speccomp.errors import OptionError, OptionTypeError, SpeccompError
from speccomp.runtime.budget import AHEAD_PAST, AHEAD_Q
from speccomp.runtime.calls import row_slots

UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "stop": None,
               "suffix": None, "tools": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0,
               "repetition_penalty": 1, "top_k": None, "min_p": 0, "response_format": {"type": "text"},
               "functions": None, "function_call": None, "tool_choice": "none", "parallel_tool_calls": None,
               # vLLM's and SGLang's extra sampling parameters, which OpenAI clients pass through
               "ignore_eos": False, "min_tokens": 0, "stop_token_ids": None, "typical_p": 1,
               "include_stop_str_in_output": False, "skip_special_tokens": True}
# accepted only at these values (or null): anything else would change the text, so it is refused, never ignored
EMPTY = {"stop": ("", []), "suffix": ("",), "tools": ([],), "functions": ([],), "logit_bias": ({},),
         "stop_token_ids": ([],), "logprobs": (False,), "top_logprobs": (0,), "top_k": (0, -1),
         "parallel_tool_calls": (False,)}
# ... and the values of those without one that mean "none" (top_k 0 or -1: vLLM's "all tokens"), of that very type
KNOWN = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
         "stream_options", "user", "safety_identifier", "prompt_cache_key", "metadata", "store", "service_tier",
         *UNSUPPORTED}
# a key outside KNOWN (and not null) is refused too: an option speccomp has never heard of may change the reply
ROLES = ("system", "developer", "user", "assistant")  # chat roles; "tool" and "function" need tools (refused)
DISCONNECT_CHECK = 0.5  # seconds between checks that a non-streaming request's client is still there


class StepFailed(RuntimeError):
    """The batch step a request's row was in failed (the server's fault, not the request's: HTTP 500)."""


class Job:
    """One request: its row's parameters, and a queue the scheduler thread feeds (token lists, then a finish reason
    or an exception) on the request's event loop."""

    def __init__(self, ids: list[int], options: dict, loop: asyncio.AbstractEventLoop):
        self.ids, self.options, self.loop = ids, options, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Scheduler:
    """The engine's batch, run by one thread; requests join and leave between steps (continuous batching)."""

    def __init__(self, engine, max_batch: int = 8, kv_slots: int = 8192, store_curve: bool = False):
        check_sizes(max_batch, kv_slots, engine.max_tree)
        engine.check_batchable(max(max_batch, 2))
        self.engine, self.max_batch = engine, max_batch
        try:
            self.batch = engine.batch(kv_slots)
        except MemoryError:
            raise OptionError("kv_slots", kv_slots, "is a larger KV cache than this machine could allocate",
                              "give a smaller --kv-slots") from None
        if self.batch.budget is not None:  # the step-cost curve now, not during the first requests
            grid = min(max_batch * engine.max_tree, AHEAD_Q), min(kv_slots, AHEAD_PAST)
            self.batch.budget.costs.measure_ahead(*grid)
            if store_curve:  # `speccomp serve` (one process on the machine): a later start begins from it
                try:
                    engine.store_step_curve(*grid)  # measures nothing more: it writes what was just measured
                except OSError as exc:  # measured all the same; only the next start measures again
                    warnings.warn(f"speccomp serve: could not store the step-cost curve ({exc}); set "
                                  "SPECCOMP_CACHE to a writable folder to keep it between starts")
        self.waiting: collections.deque[Job] = collections.deque()
        self.jobs: dict[int, Job] = {}
        self.wake = threading.Condition()
        self.counts = collections.Counter()
        self.recent: collections.deque = collections.deque(maxlen=256)  # (time, tokens) of recent steps
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="speccomp-scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (its row is checked here: a bad request raises before it waits)."""
        try:
            job.row = self.engine.row(job.ids, **job.options)
        except (OptionError, OptionTypeError) as exc:  # the API's names for generate's parameters
            name = {"max_new_tokens": "max_tokens", "input_ids": "prompt"}.get(exc.parameter, exc.parameter)
            raise type(exc)(name, exc.value, exc.problem.replace("max_new_tokens", "max_tokens"), exc.fix) from None
        need = self.batch.need(len(job.ids), job.row.max_new_tokens)
        if need > self.batch.cache.shape[4]:
            raise OptionError("max_tokens", job.row.max_new_tokens, f"the prompt ({len(job.ids)} tokens) and the reply "
                              f"need {need} cache slots; this server holds {self.batch.cache.shape[4]}",
                              "ask for fewer tokens, or start the server with a larger --kv-slots")
        with self.wake:
            self.counts["requests"] += 1
            self.waiting.append(job)
            self.wake.notify()

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens can ask for here: the model's (and a draft model's)
        context, and this server's cache slots (a request that leaves max_tokens unset asks for at most this)."""
        limits = [self.batch.cache.shape[4] - self.batch.need(prompt_len, 0)]
        for context in (self.engine.max_positions, getattr(self.engine.drafter, "max_positions", None)):
            if context is not None:
                limits.append(context - prompt_len)
        return min(limits)

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def _admit(self) -> None:
        while self.waiting and len(self.jobs) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled:  # its client went away while it waited
                self.waiting.popleft()
                self.counts["cancelled"] += 1
                continue
            if self.batch.need(len(job.ids), job.row.max_new_tokens) > self.batch.free():
                return  # first come, first served: it waits for room
            self.waiting.popleft()
            self.jobs[self.batch.add(job.row)] = job

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.stopped and not self.waiting and not self.jobs:
                    self.wake.wait()
                if self.stopped:
                    return
                self._admit()
                if self.batch.budget is not None:  # a freed place is taken at once: tokens at the mean price
                    self.batch.budget.queued = any(not job.cancelled for job in self.waiting)
            try:
                before = self.batch.forwards
                emitted = self.batch.step()
            except Exception as exc:  # a failing step fails the rows in it, not the server
                for rid, job in list(self.jobs.items()):
                    self.batch.remove(rid)
                    self.counts["failed"] += 1
                    job.put(StepFailed(f"the batch step failed: {type(exc).__name__}: {exc}"))
                self.jobs.clear()
                continue
            if self.batch.forwards > before:  # a step with no row to run (its only client gone) ran nothing
                with self.wake:  # /metrics reads it from the event loop's thread
                    self.counts["forwards"] += 1
                    self.recent.append((time.perf_counter(), sum(len(t) for t in emitted.values())))
            for rid, tokens in emitted.items():
                job = self.jobs[rid]
                self.counts["tokens"] += len(tokens)
                self.counts["row_steps"] += 1
                if tokens and not job.cancelled:
                    job.put(tokens)
            for rid, job in list(self.jobs.items()):
                row = self.batch.rows[rid]
                if row.done or job.cancelled:
                    self.batch.remove(rid)
                    del self.jobs[rid]
                    self.counts["cancelled" if job.cancelled else "finished"] += 1
                    job.put("stop" if row.out and row.out[-1] in row.eos else "length")

    def metrics(self) -> str:
        """Prometheus text exposition."""
        now = time.perf_counter()
        with self.wake:
            window = [(t, n) for t, n in self.recent if now - t <= 10.0]
            waiting = sum(not job.cancelled for job in self.waiting)
        tps = sum(n for _, n in window) / (now - window[0][0]) if len(window) > 1 and now > window[0][0] else 0.0
        c = self.counts
        rows = [
            ("requests_total", "counter", "requests accepted", c["requests"]),
            ("requests_finished_total", "counter", "requests answered in full", c["finished"]),
            ("requests_cancelled_total", "counter", "requests whose client went away", c["cancelled"]),
            ("requests_refused_total", "counter", "requests answered 4xx", c["refused"]),
            ("requests_failed_total", "counter", "requests whose batch step failed (answered 500)", c["failed"]),
            ("tokens_generated_total", "counter", "tokens generated", c["tokens"]),
            ("forwards_total", "counter", "target forwards (one per batch step)", c["forwards"]),
            ("row_steps_total", "counter", "rows summed over forwards (/ forwards_total: the mean batch size)",
             c["row_steps"]),
            ("tokens_per_row_step", "gauge", "tokens a row gained per step it took part in (speculation's tau)",
             c["tokens"] / c["row_steps"] if c["row_steps"] else 0.0),
            ("tokens_per_second", "gauge", "tokens generated per second over the last 10 s", tps),
            ("running_requests", "gauge", "rows in the batch", len(self.jobs)),
            ("waiting_requests", "gauge", "requests waiting for room", waiting),
        ]
        return "".join(f"# HELP speccomp_{n} {h}\n# TYPE speccomp_{n} {t}\nspeccomp_{n} {v}\n" for n, t, h, v in rows)


def check_sizes(max_batch, kv_slots, max_tree: int) -> None:
    """--max-batch and --kv-slots: positive ints, and room for at least one request (`speccomp serve` and each Ray
    replica check them; serve_replicas before any replica starts)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise OptionError("max_batch", max_batch, "must be a positive int: the rows decoded together", "e.g. 8")
    least = row_slots(1, 1, max_tree)  # a one-token prompt and one new token, with its tree's room
    if isinstance(kv_slots, bool) or not isinstance(kv_slots, int) or kv_slots < least:
        raise OptionError("kv_slots", kv_slots, f"must be an int >= {least}: every request needs its prompt, its "
                          f"reply and {max_tree + 1} slots for its last step's tree", "e.g. 8192 (the default)")


def _options(body: dict, default_max_tokens: int | None, chat: bool) -> dict:
    """generate()'s options from an OpenAI request body (checked by the engine's own checks after this)."""
    reads, other = ("messages", "prompt") if chat else ("prompt", "messages")
    if body.get(other) is not None:  # the other endpoint's input would be dropped
        raise OptionError(other, body[other], f"is read by {'/v1/completions' if chat else '/v1/chat/completions'}"
                          f"; this endpoint reads {reads!r}", f"send it to that endpoint, or leave {other!r} out")
    for key in sorted(set(body) - KNOWN - {reads}):
        if body[key] is not None:  # null asks for the default
            raise OptionError(key, body[key], "is not a parameter speccomp serve knows; refused rather than ignored",
                              "leave it out")
    for key, allowed in UNSUPPORTED.items():
        value = body.get(key)
        if value is None or any(type(value) is type(e) and value == e for e in EMPTY.get(key, ())):
            continue  # unset, or an empty value of the key's own type (stop: [], logprobs: false; not stop: 0)
        if allowed is None or value != allowed or isinstance(value, bool) != isinstance(allowed, bool):  # n: true
            raise OptionError(key, body[key], "is not supported by speccomp serve", f"leave it out or use {allowed!r}")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise OptionTypeError("stream", body["stream"], "must be true or false (JSON booleans, not strings)",
                              'send "stream": true or leave it out')
    def given(key: str, default):  # null asks for the default, as in OpenAI's API (clients send it for "unset")
        return default if body.get(key) is None else body[key]

    temperature = given("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise OptionError("temperature", temperature, "must be a number >= 0", "0 for greedy decoding")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise OptionError("stream_options", body["stream_options"], "applies only to a stream",
                          'add "stream": true, or leave stream_options out')
    limits = {key: body.get(key) for key in ("max_tokens", "max_completion_tokens")}  # OpenAI's old and new name
    for key, value in limits.items():  # each checked as sent
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OptionError(key, value, "must be a positive int")
    old, new = limits.values()
    if None not in (old, new) and old != new:
        raise OptionError("max_completion_tokens", new, f"differs from max_tokens={old}; they name the same limit",
                          "send one of them")
    seed = body.get("seed")  # checked when greedy too, where it is not used: a wrong type is a client's bug
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise OptionError("seed", seed, "must be an int in [0, 2**63)", "or leave it out")
    max_tokens = next((v for v in limits.values() if v is not None), default_max_tokens)
    return {"max_new_tokens": max_tokens, "do_sample": temperature > 0, "temperature": temperature or 1.0,
            "top_p": given("top_p", 1.0), "seed": seed if temperature > 0 else None}  # greedy: no draw


def _error_handlers(app, scheduler) -> None:
    """OpenAI-shaped error bodies: a refused request is a 400 naming its parameter (and counted), a failed step a 500."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    def error(status: int, message: str, param=None) -> JSONResponse:
        scheduler.counts["refused"] += 1
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                       "code": None}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return error(400, f"the request body is not valid JSON of the expected shape: {exc.errors()}")

    @app.exception_handler(SpeccompError)
    async def _refused(request, exc):
        return error(400, str(exc), getattr(exc, "parameter", None))

    @app.exception_handler(StepFailed)
    async def _failed(request, exc):
        return JSONResponse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}},
                            status_code=500)


def make_app(engine, max_batch: int = 8, kv_slots: int = 8192, name: str | None = None, store_curve: bool = False):
    """The FastAPI app serving `engine` (a loaded speccomp Engine); its scheduler thread starts now. store_curve: store
    the step-cost curve measured at the start for later starts (`speccomp serve`; not Ray replicas, which start
    together and would store what they measured while competing for the cores)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    scheduler = Scheduler(engine, max_batch, kv_slots, store_curve)
    model_name = name or engine.manifest["model"].get("name") or "speccomp"

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.stop()

    app = FastAPI(title="speccomp", description=__doc__.split("\n\n")[0], lifespan=lifespan)
    app.state.scheduler = scheduler
    app.add_middleware(_ServerHeader, server=f"{socket.gethostname()}:{os.getpid()}")

    _error_handlers(app, scheduler)
    started = int(time.time())  # OpenAI's model objects carry `created` (Unix seconds): here, when serving began

    @app.get("/health")
    async def health():  # 503 where the scheduler thread died: a load balancer must stop sending requests here
        alive = scheduler.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "scheduler stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(scheduler.metrics())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "speccomp"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        return await _respond(scheduler, engine, model_name, request, _prompt_ids(engine, body), body, False, 16)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        return await _respond(scheduler, engine, model_name, request, _message_ids(engine, body), body, True, 256)

    return app


async def _respond(scheduler, engine, model_name: str, request, ids: list[int], body: dict, chat: bool,
                   default_max_tokens: int):
    """One completion request, submitted to the scheduler: its JSON reply, or a stream of server-sent events."""
    from fastapi.responses import JSONResponse

    room = scheduler.room(len(ids))  # unset max_tokens: the default, or what room the prompt leaves if less
    if room < 1 and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        raise OptionError("prompt", f"{len(ids)} tokens", "leaves no room for a reply in the model's context or this "
                          "server's cache (--kv-slots)", "shorten the prompt")
    default_max_tokens = max(1, min(default_max_tokens, room))
    job = Job(ids, _options(body, default_max_tokens, chat), asyncio.get_running_loop())
    # stream_options.include_usage: every chunk carries "usage": null, a last chunk (no choices) the counts
    usage = len(ids) if body.get("stream") and _stream_options(body).get("include_usage") else None
    scheduler.submit(job)
    kind = "chat.completion" if chat else "text_completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}
    if body.get("stream"):
        return _job_stream(job, _stream(engine, job, head, kind, chat, usage), media_type="text/event-stream")
    tokens, finish = await _collect(job, request)
    if finish is None:
        return JSONResponse({}, status_code=499)
    text = _text(engine, tokens, [] if chat else ids)  # a completion's text reads on from its prompt
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
              else {"index": 0, "text": text, "logprobs": None})
    return {**head, "object": kind, "choices": [{**choice, "finish_reason": finish, "token_ids": tokens}],
            "usage": _usage(len(ids), len(tokens))}


def _job_stream(job: Job, content, **options):
    """A StreamingResponse that lets the job's row go however the response ends: a client that disconnects before
    the first event cancels the stream before `_stream` runs at all (so its own `finally` never does)."""
    from fastapi.responses import StreamingResponse

    class JobStream(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                job.cancelled = True  # a finished job's row is gone already: then this changes nothing

    return JobStream(content, **options)


async def _collect(job: Job, request) -> tuple[list[int], str | None]:
    """A non-streaming job's tokens and finish reason; (tokens, None) when the client went away (its row freed)."""
    tokens, loop = [], asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), timeout=DISCONNECT_CHECK)
            except asyncio.TimeoutError:
                item = None
            if loop.time() - checked >= DISCONNECT_CHECK or item is None:  # also while tokens keep coming
                checked = loop.time()
                if await request.is_disconnected():
                    job.cancelled = True  # the scheduler frees its row
                    return tokens, None
            if item is None:
                continue
            if isinstance(item, Exception):
                raise item
            if isinstance(item, str):
                return tokens, item
            tokens += item
    except asyncio.CancelledError:
        job.cancelled = True
        raise


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _stream_options(body: dict) -> dict:
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise OptionError("stream_options", options, "takes only include_usage", 'e.g. {"include_usage": true}')
    return options


async def _stream(engine, job: Job, head: dict, kind: str, chat: bool, prompt_tokens: int | None = None):
    """A streaming job as server-sent events: text pieces as they decode whole characters, then [DONE].
    `prompt_tokens` given (stream_options.include_usage): usage null on each chunk, then one chunk with the counts."""
    tokens, sent, sent_tokens, done = [], "", 0, False
    chunk = kind + ".chunk" if chat else kind  # OpenAI's streamed object names
    text_of = _reply_text(engine, [] if chat else job.ids)
    if prompt_tokens is not None:
        head = {**head, "usage": None}
    try:
        if chat:
            yield _event({**head, "object": chunk,
                          "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        while not done:
            item = await job.queue.get()
            if isinstance(item, Exception):
                yield _event({"error": {"message": str(item), "type": "server_error"}})
                return
            done = isinstance(item, str)
            tokens += [] if done else item
            text = text_of(tokens)
            if text.endswith("\ufffd") and not done:
                continue  # a character cut between tokens: wait for the rest of its bytes
            piece, sent = text[len(sent):], text
            part = {"delta": {"content": piece}} if chat else {"text": piece}
            yield _event({**head, "object": chunk, "choices": [{"index": 0, **part, "token_ids": tokens[sent_tokens:],
                                                                "finish_reason": item if done else None}]})
            sent_tokens = len(tokens)
        if prompt_tokens is not None:
            yield _event({**head, "object": chunk, "choices": [], "usage": _usage(prompt_tokens, len(tokens))})
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            job.cancelled = True  # the client went away: the scheduler frees its row


def _prompt_ids(engine, body: dict) -> list[int]:
    """/v1/completions' prompt: a string or a list of token ids (a batch of one of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _need_tokenizer(engine, "prompt", prompt)
        return list(engine.text_ids(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise OptionTypeError("prompt", prompt, "must be a string or a list of token ids (one prompt a request)")


def _message_ids(engine, body: dict) -> list[int]:
    """/v1/chat/completions' messages through the engine's chat template."""
    messages = body.get("messages")
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise OptionTypeError("messages", messages, "must be a non-empty list of {role, content} objects with "
                              "string content")
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise OptionError(f"messages[{i}].role", m["role"], "is not a chat role speccomp serve takes (tool "
                              "messages need tools, which it does not support)", f"one of {list(ROLES)}")
    _need_tokenizer(engine, "messages", messages)
    return engine.chat_ids(messages)[0].tolist()


def _need_tokenizer(engine, name: str, value) -> None:
    """Text needs the engine's tokenizer: without one, a 400 naming the field (token ids still work)."""
    if not engine.manifest.get("tokenizer"):
        raise OptionError(name, value, "is text, but this engine was exported without a tokenizer",
                          "send the prompt as token ids (/v1/completions), or re-export the engine with tokenizer=")


class _ServerHeader:
    """`x-speccomp-server: host:pid` on every response: which process answered (one of several Ray Serve replicas).
    Plain ASGI, not BaseHTTPMiddleware, so streams and client disconnects pass through untouched."""

    def __init__(self, app, server: str):
        self.app, self.header = app, (b"x-speccomp-server", server.encode())

    async def __call__(self, scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


async def _body(request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int past Python's 4300 digits
        raise OptionError("body", "<request body>", f"is not JSON that can be read ({exc})") from None
    if not isinstance(body, dict):
        raise OptionTypeError("body", body, "must be a JSON object")
    try:  # JSON's "\ud83d" (half an emoji) parses to a lone surrogate, which is no text (nor a key to name)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise OptionError("body", "<request body>", "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                          "text", "send well-formed Unicode (a whole surrogate pair)") from None
    return body


def _text(engine, tokens: list[int], prompt: list[int]) -> str:
    """The reply `tokens`' text after `prompt` (see _reply_text)."""
    return _reply_text(engine, prompt)(tokens)


def _reply_text(engine, prompt: list[int]):
    """tokens -> the reply's text as it reads after `prompt` (a completion's; a chat reply's is []): decoded behind the
    prompt's last tokens, whose text is then cut off, so prompt + text is the whole sequence decoded, as OpenAI's API
    (a SentencePiece tokenizer drops the leading space of a text's first word: decoded apart, "w5 w6" and "w7" join
    into "w5 w6w7"). The window's own text is decoded once, not once per streamed event."""
    if not engine.manifest.get("tokenizer"):
        return lambda tokens: ""
    window = prompt[-WINDOW:]
    head = engine.decode(window)

    def text(tokens: list[int]) -> str:
        after = text_after(engine.decode, window, tokens, head)
        return engine.decode(tokens) if after is None else after

    return text


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(engine_dir, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, kv_slots: int = 8192,
          provider: str = "cpu", threads: int | None = None, draft: bool = True) -> None:
    """Load the engine and serve it until interrupted (`draft=False`: plain decoding on its target graph, for
    engines whose drafter cannot batch)."""
    import uvicorn

    from speccomp.engine.runtime import load

    app = make_app(load(engine_dir, provider=provider, threads=threads, draft=draft), max_batch, kv_slots,
                   store_curve=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
