"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Each request becomes one TGI-shaped `GenerateRequest` run through the shared `Service`, so admission,
validation, cancellation on disconnect and metrics are the same as for /generate. What is OpenAI's own is
here: the request fields (temperature 0 is greedy, the default 1.0 samples, as in vLLM), the chat template,
stop sequences cut from the text, logprobs in OpenAI's two shapes, usage, and the SSE chunks ending with
`data: [DONE]`.
"""
import asyncio
import json
import re
import time
import uuid
from typing import Callable, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from router.api.errors import APIError, error_body
from router.api.openai_schemas import (DEFAULT_COMPLETION_TOKENS, FINISH_REASONS, ChatCompletionRequest,
                                       CompletionRequest, chat_prompt, check_top_logprobs, completion_prompt, invalid,
                                       max_top_logprobs, to_parameters)
from router.api.openai_tools import Tools, ToolStream, parse, resolve
from router.api.openai_text import TextStream, Vocab, chat_logprobs, completion_logprobs, cut_at_stop, usage
from router.api.service import Service
from router.api.validation import GenerateRequest, Parameters
from router.job import Job, Token

Chunk = Callable[[str, list[Token], Optional[str]], dict]  # (delta text, tokens, finish reason) -> a choice


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class OpenAIRoutes:
    def __init__(self, svc: Service):
        self.svc = svc
        self.started = int(time.time())
        self.vocab = Vocab(svc.tokenizer)

    def card(self) -> dict:
        return {"id": self.svc.model_name, "object": "model", "created": self.started, "owned_by": "cb",
                "max_model_len": self.svc.limits.max_total_tokens}

    async def list_models(self):
        return {"object": "list", "data": [self.card()]}

    async def get_model(self, model: str):
        if model != self.svc.model_name:
            raise APIError(404, f"The model `{model}` does not exist", "model_not_found", "model")
        return self.card()

    def head(self, job: Job, prefix: str, kind: str) -> dict:
        """The fields every response and chunk of a job starts with."""
        version = self.svc.info.version if self.svc.info else "0"
        return {"id": f"{prefix}-{job.id}-{uuid.uuid4().hex[:12]}", "object": kind, "created": int(time.time()),
                "model": self.svc.model_name, "system_fingerprint": f"cb-{version}"}

    async def start(self, inputs, parameters: Parameters, prompt_field: str, tokens_field: str = "max_tokens",
                    grammar_field: str = "response_format", n: int = 1) -> list[Job]:
        """svc.start_choices, with TGI's field names in validation messages renamed to this API's, and the first
        field a message names as its `param`."""
        try:
            return await self.svc.start_choices(GenerateRequest(inputs=inputs, parameters=parameters), n)
        except APIError as e:
            if e.kind == "validation":
                for tgi, ours in (("`max_new_tokens`", f"`{tokens_field}`"), ("`inputs`", f"`{prompt_field}`"),
                                  ("`grammar`", f"`{grammar_field}`")):
                    e.message = e.message.replace(tgi, ours)
                named = re.search(r"`(\w+)`", e.message)
                e.param = e.param or (named.group(1) if named else None)
            raise

    async def choice_events(self, index: int, job: Job, stop: list[str], head: dict, chunk: Chunk,
                            with_logprobs: bool, first: Optional[dict], tools: Optional[Tools]):
        """One choice's SSE chunks: `chunk` shapes it; `first` is sent before any token; with `tools`, the text
        goes through a ToolStream and leaves as content and tool-call deltas."""
        def out(choice: dict) -> str:
            return sse({**head, "choices": [{**choice, "index": index}]})
        text, calls = TextStream(stop), ToolStream(tools) if tools else None
        if first is not None:
            yield out(first)
        async for kind, payload in self.svc.events(job):
            if kind == "error":
                yield sse(error_body(True, 424, payload, "generation"))
            elif kind == "token":
                delta = text.push(payload, payload.final)
                if calls is not None:
                    for d in calls.push(delta, payload.final):
                        yield out({"delta": d, "logprobs": None, "finish_reason": None})
                elif delta or (with_logprobs and not payload.special):
                    yield out(chunk(delta, [payload], None))
            elif kind == "end":
                called = calls is not None and calls.called and job.finish_reason != "length"
                yield out(chunk("", [], "tool_calls" if called else FINISH_REASONS.get(job.finish_reason, "stop")))

    async def stream(self, jobs: list[Job], stop: list[str], head: dict, chunks: list[Chunk], with_logprobs: bool,
                     include_usage: bool, first: Optional[dict] = None, tools: Optional[Tools] = None):
        """SSE for streamed jobs, one choice each (its `index`), interleaved as their tokens come."""
        sources = [self.choice_events(i, job, stop, head, chunks[i], with_logprobs, first, tools)
                   for i, job in enumerate(jobs)]
        if len(sources) == 1:
            async for line in sources[0]:
                yield line
        else:
            async for line in merged(sources):
                yield line
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(jobs)})
        yield "data: [DONE]\n\n"

    def respond(self, jobs: list[Job], prefix: str, kind: str, choices: list[dict]) -> JSONResponse:
        for i, (job, choice) in enumerate(zip(jobs, choices)):
            called = bool(choice.get("message", {}).get("tool_calls"))
            choice["index"] = i
            choice["finish_reason"] = "tool_calls" if called else FINISH_REASONS.get(job.finish_reason, "stop")
        return JSONResponse({**self.head(jobs[0], prefix, kind), "choices": choices, "usage": usage(jobs)})

    async def chat(self, req: ChatCompletionRequest, http: HttpRequest):
        check_top_logprobs(req.top_logprobs, max_top_logprobs(self.svc, "chat"), "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = to_parameters(req, getattr(req, field), top_n, field)
        tools = resolve(req.tools, req.tool_choice, getattr(self.svc.tokenizer, "chat_template", None))
        if tools is not None and tools.constrained:
            if params.grammar is not None:
                raise invalid("`tool_choice` required or a named function cannot be combined with `response_format` "
                              "or `structured_outputs`", "tool_choice")
            params.grammar = tools.grammar()
        # the chat template tokenizes: a long conversation must not stall the batching loop
        prompt = await asyncio.to_thread(chat_prompt, self.svc, req, tools)
        jobs = await self.start(prompt, params, "messages", field, "tools" if tools else grammar_field(req),
                                req.n or 1)
        if req.stream:
            def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                return {"delta": {"content": delta} if delta or not finish else {},
                        "logprobs": chat_logprobs(self.vocab, tokens, top_n) if req.logprobs and tokens else None,
                        "finish_reason": finish}
            first = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(jobs, params.stop, self.head(jobs[0], "chatcmpl", "chat.completion.chunk"),
                                                 [chunk] * len(jobs), bool(req.logprobs), include_usage, first, tools),
                                     media_type="text/event-stream")
        await self.svc.follow(jobs, http)
        choices = []
        for job in jobs:
            message = {"role": "assistant", "content": cut_at_stop(self.svc.text(job), params.stop)}
            if tools is not None:
                message["content"], calls = parse(message["content"], tools)
                if calls:
                    message["tool_calls"] = calls
            logprobs = chat_logprobs(self.vocab, job.tokens, top_n) if req.logprobs else None
            choices.append({"message": message, "logprobs": logprobs})
        return self.respond(jobs, "chatcmpl", "chat.completion", choices)

    async def completions(self, req: CompletionRequest, http: HttpRequest):
        check_top_logprobs(req.logprobs, max_top_logprobs(self.svc, "completions"), "logprobs")
        top_n = req.logprobs or 0
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        params = to_parameters(req, max_tokens, top_n)
        prompt = completion_prompt(req)
        n = req.n or 1
        best_of = req.best_of or n
        jobs = await self.start(prompt, params, "prompt", grammar_field=grammar_field(req), n=best_of)
        echo = (prompt if isinstance(prompt, str) else self.svc.tokenizer.decode(prompt)) if req.echo else ""
        if req.stream:
            def chunk_for() -> Chunk:
                offset = [len(echo)]

                def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                    logprobs = None
                    if req.logprobs is not None and tokens:
                        logprobs = completion_logprobs(self.vocab, tokens, top_n, offset[0])
                        offset[0] += sum(len(t) for t in logprobs["tokens"])
                    return {"text": delta, "logprobs": logprobs, "finish_reason": finish}
                return chunk
            first = {"text": echo, "logprobs": None, "finish_reason": None} if echo else None
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(jobs, params.stop, self.head(jobs[0], "cmpl", "text_completion"),
                                                 [chunk_for() for _ in jobs], req.logprobs is not None,
                                                 include_usage, first),
                                     media_type="text/event-stream")
        await self.svc.follow(jobs, http)
        if best_of > n:  # the n most likely, as OpenAI's best_of
            jobs = sorted(jobs, key=lambda j: j.cumulative_logprob, reverse=True)[:n]
        choices = []
        for job in jobs:
            text = echo + cut_at_stop(self.svc.text(job), params.stop)
            logprobs = completion_logprobs(self.vocab, job.tokens, top_n) if req.logprobs is not None else None
            choices.append({"text": text, "logprobs": logprobs})
        return self.respond(jobs, "cmpl", "text_completion", choices)


async def merged(sources: list):
    """Items of several async generators as each comes; leaving early closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(source) -> None:
        try:
            async for item in source:
                await queue.put(item)
        finally:
            await queue.put(None)
    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def grammar_field(req) -> str:
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def install_openai_routes(app: FastAPI, svc: Service) -> None:
    routes = OpenAIRoutes(svc)
    app.get("/v1/models")(routes.list_models)
    app.get("/v1/models/{model:path}")(routes.get_model)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
