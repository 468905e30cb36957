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
from router.api.openai_tools import ToolStream, parse, resolve
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
                    grammar_field: str = "response_format") -> Job:
        """svc.start, with TGI's field names in validation messages renamed to this API's, and the first field
        a message names as its `param`."""
        try:
            return await self.svc.start(GenerateRequest(inputs=inputs, parameters=parameters))
        except APIError as e:
            if e.kind == "validation":
                for tgi, ours in (("`max_new_tokens`", f"`{tokens_field}`"), ("`inputs`", f"`{prompt_field}`"),
                                  ("`grammar`", f"`{grammar_field}`")):
                    e.message = e.message.replace(tgi, ours)
                named = re.search(r"`(\w+)`", e.message)
                e.param = e.param or (named.group(1) if named else None)
            raise

    async def run(self, job: Job, http: HttpRequest) -> None:
        """Follows a non-streamed job to its end; an error or a vanished client becomes an APIError."""
        async for kind, payload in self.svc.events(job, http):
            if kind == "error":
                raise APIError(424, payload, "generation")
        if job.finish_reason is None:
            raise APIError(499, "client closed the request", "cancelled")

    async def stream(self, job: Job, stop: list[str], head: dict, chunk: Chunk, with_logprobs: bool,
                     include_usage: bool, first: Optional[dict] = None, tools: Optional[ToolStream] = None):
        """SSE for a streamed job: `chunk` shapes each choice; `first` is sent before any token; with `tools`,
        the text goes through it and leaves as content and tool-call deltas."""
        text = TextStream(stop)
        if first is not None:
            yield sse({**head, "choices": [first]})
        async for kind, payload in self.svc.events(job):
            if kind == "error":
                yield sse(error_body(True, 424, payload, "generation"))
            elif kind == "token":
                delta = text.push(payload, payload.final)
                if tools is not None:
                    for d in tools.push(delta, payload.final):
                        yield sse({**head, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                                        "finish_reason": None}]})
                elif delta or (with_logprobs and not payload.special):
                    yield sse({**head, "choices": [chunk(delta, [payload], None)]})
            elif kind == "end":
                called = tools is not None and tools.called and job.finish_reason != "length"
                finish = "tool_calls" if called else FINISH_REASONS.get(job.finish_reason, "stop")
                yield sse({**head, "choices": [chunk("", [], finish)]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(job)})
        yield "data: [DONE]\n\n"

    def respond(self, job: Job, prefix: str, kind: str, choice: dict) -> JSONResponse:
        called = bool(choice.get("message", {}).get("tool_calls"))
        choice["finish_reason"] = "tool_calls" if called else FINISH_REASONS.get(job.finish_reason, "stop")
        return JSONResponse({**self.head(job, prefix, kind), "choices": [choice], "usage": usage(job)})

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
        job = await self.start(prompt, params, "messages", field, "tools" if tools else grammar_field(req))
        if req.stream:
            def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                return {"index": 0, "delta": {"content": delta} if delta or not finish else {},
                        "logprobs": chat_logprobs(self.vocab, tokens, top_n) if req.logprobs and tokens else None,
                        "finish_reason": finish}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(job, params.stop, self.head(job, "chatcmpl", "chat.completion.chunk"),
                                                 chunk, bool(req.logprobs), include_usage, first,
                                                 ToolStream(tools) if tools else None),
                                     media_type="text/event-stream")
        await self.run(job, http)
        message = {"role": "assistant", "content": cut_at_stop(self.svc.text(job), params.stop)}
        if tools is not None:
            message["content"], calls = parse(message["content"], tools)
            if calls:
                message["tool_calls"] = calls
        logprobs = chat_logprobs(self.vocab, job.tokens, top_n) if req.logprobs else None
        return self.respond(job, "chatcmpl", "chat.completion", {"index": 0, "message": message, "logprobs": logprobs})

    async def completions(self, req: CompletionRequest, http: HttpRequest):
        check_top_logprobs(req.logprobs, max_top_logprobs(self.svc, "completions"), "logprobs")
        top_n = req.logprobs or 0
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        params = to_parameters(req, max_tokens, top_n)
        prompt = completion_prompt(req)
        job = await self.start(prompt, params, "prompt", grammar_field=grammar_field(req))
        echo = (prompt if isinstance(prompt, str) else self.svc.tokenizer.decode(prompt)) if req.echo else ""
        if req.stream:
            offset = [len(echo)]

            def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                logprobs = None
                if req.logprobs is not None and tokens:
                    logprobs = completion_logprobs(self.vocab, tokens, top_n, offset[0])
                    offset[0] += sum(len(t) for t in logprobs["tokens"])
                return {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            first = {"index": 0, "text": echo, "logprobs": None, "finish_reason": None} if echo else None
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(job, params.stop, self.head(job, "cmpl", "text_completion"), chunk,
                                                 req.logprobs is not None, include_usage, first),
                                     media_type="text/event-stream")
        await self.run(job, http)
        text = echo + cut_at_stop(self.svc.text(job), params.stop)
        logprobs = completion_logprobs(self.vocab, job.tokens, top_n) if req.logprobs is not None else None
        return self.respond(job, "cmpl", "text_completion", {"index": 0, "text": text, "logprobs": logprobs})


def grammar_field(req) -> str:
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def install_openai_routes(app: FastAPI, svc: Service) -> None:
    routes = OpenAIRoutes(svc)
    app.get("/v1/models")(routes.list_models)
    app.get("/v1/models/{model:path}")(routes.get_model)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
