"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Each request becomes one TGI-shaped `GenerateRequest` run through the shared `Service`, so admission,
validation, cancellation on disconnect and metrics are the same as for /generate. What is OpenAI's own is
here: the request fields (temperature 0 is greedy, the default 1.0 samples, as in vLLM), the chat template,
stop sequences cut from the text (OpenAI never shows them, TGI does), logprobs in OpenAI's two shapes, usage,
and the SSE chunks ending with `data: [DONE]`.
"""
import json
import time
import uuid
from functools import lru_cache
from typing import Any, Optional, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from router.job import Job, Token
from router.service import APIError, Service
from router.validation import GenerateRequest, Parameters

OPENAI_TYPES = {422: "invalid_request_error", 400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 424: "server_error"}
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's own limits (the router's may be lower)


def openai_error(status: int, message: str, kind: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, kind, param), status_code=status)


def _error_body(status: int, message: str, kind: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
                      "code": kind}}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "validation", param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def invalid(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(422, message, "validation", param)


# ---- request shapes -------------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class Common(BaseModel):
    """Fields both routes take. Unknown fields are ignored, as OpenAI-compatible servers do."""
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extensions
    ignore_eos: bool = False
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = None


class ChatMessage(BaseModel):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


# ---- translating a request -------------------------------------------------------------------------------------

def to_parameters(req: Common, max_tokens: Optional[int], top_n: int) -> Parameters:
    if req.n is not None and req.n != 1:
        raise invalid(f"`n` must be 1: cb returns a single choice per request (got n={req.n})", "n")
    if max_tokens is not None and max_tokens < 1:
        raise invalid("`max_tokens` must be at least 1", "max_tokens")
    if req.temperature is not None and req.temperature < 0:
        raise invalid("`temperature` must be >= 0", "temperature")
    if req.seed is not None and not 0 <= req.seed < 2**64:
        raise invalid("`seed` must be in [0, 2**64)", "seed")
    if req.presence_penalty:
        raise invalid("`presence_penalty` is not supported (use `frequency_penalty`)", "presence_penalty")
    if req.logit_bias:
        raise invalid("`logit_bias` is not supported", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    greedy = req.temperature == 0  # OpenAI's and vLLM's meaning: top_p/top_k/seed are then moot
    extra = {"top_n_tokens": top_n} if top_n and "top_n_tokens" in Parameters.model_fields else {}
    return Parameters(
        max_new_tokens=max_tokens, do_sample=not greedy,
        temperature=None if greedy else req.temperature, top_p=None if greedy else req.top_p,
        top_k=None if greedy else req.top_k, seed=req.seed,
        frequency_penalty=req.frequency_penalty or None, repetition_penalty=req.repetition_penalty,
        stop=[s for s in stop if s], ignore_eos=req.ignore_eos, details=True, **extra,
    )


def message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"messages[{i}]: only text content parts are supported (got {part.get('type')!r})",
                          "messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(svc: Service, req: ChatCompletionRequest) -> list[int]:
    if not req.messages:
        raise invalid("`messages` cannot be empty", "messages")
    if req.tools:
        raise invalid("`tools` are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise invalid("only `response_format` {\"type\": \"text\"} is supported", "response_format")
    if getattr(svc.tokenizer, "chat_template", None) is None:
        raise invalid("this model has no chat template: use /v1/completions", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        msg = {"role": m.role, "content": message_text(m, i)}
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    try:
        ids = svc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja2's TemplateError (a template's raise_exception), ValueError, TypeError
        raise invalid(f"the chat template refused these messages: {e}", "messages") from e
    if not isinstance(ids, list):  # a BatchEncoding where transformers returns a dict
        ids = ids["input_ids"]
    return list(ids)


def completion_prompt(req: CompletionRequest) -> Union[str, list[int]]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise invalid(f"one prompt per request: got {len(p)} (batched prompts are not supported)", "prompt")
        p = p[0]
    if not p:
        raise invalid("`prompt` cannot be empty", "prompt")
    if req.suffix:
        raise invalid("`suffix` is not supported", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise invalid("`best_of` must be 1", "best_of")
    if req.echo and req.logprobs is not None:
        raise invalid("`echo` with `logprobs` is not supported (no prompt logprobs)", "echo")
    return p


def max_top_logprobs(svc: Service, route: str) -> int:
    return min(MAX_TOP_LOGPROBS[route], getattr(svc.limits, "max_top_n_tokens", MAX_TOP_LOGPROBS[route]))


def start(svc: Service, inputs, parameters: Parameters, prompt_field: str) -> Job:
    """svc.start, with TGI's field names in validation messages renamed to this API's."""
    try:
        return svc.start(GenerateRequest(inputs=inputs, parameters=parameters))
    except APIError as e:
        message = e.message
        if e.kind == "validation":
            for tgi, ours in (("`max_new_tokens`", "`max_tokens`"), ("`inputs`", f"`{prompt_field}`")):
                message = message.replace(tgi, ours)
        raise OpenAIError(e.status, message, e.kind) from e


# ---- text and logprobs -----------------------------------------------------------------------------------------

class TextStream:
    """Streamed tokens → text deltas: special tokens dropped, a stop sequence and what follows cut off, and text
    that could be the start of a stop sequence held back until it is known not to be one."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.text = ""
        self.sent = 0

    def push(self, token: Token, finished: bool) -> str:
        if not token.special:
            self.text += token.text
        end = len(self.text)
        if self.stop:
            # Nothing sent so far can begin a stop sequence (it would have been held back), so search from `sent`.
            found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if found:
                end = min(found)
            elif not finished:
                end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        delta = self.text[self.sent:max(end, self.sent)]
        self.sent += len(delta)
        return delta


def cut_at_stop(text: str, stop: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(found)] if found else text


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet, reversed: a byte-level BPE token's characters → its raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_decoder()


class Vocab:
    """A token id's own text and bytes, as logprobs show them (the bytes of a token that is part of a
    multi-byte character are its raw bytes where the tokenizer is byte-level)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._get)

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = list(text.encode("utf-8"))
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in BYTE_DECODER for c in piece):
                raw = [BYTE_DECODER[c] for c in piece]
        return text, raw


def top_tokens(token: Token) -> list[Token]:
    # `Token.top_tokens` (best first) comes with TGI's top_n_tokens; absent, there are no alternatives to show.
    return list(getattr(token, "top_tokens", None) or [])


def chat_logprobs(vocab: Vocab, tokens: list[Token], top_n: int) -> dict:
    def entry(t: Token) -> dict:
        text, raw = vocab.get(t.id)
        return {"token": text, "logprob": t.logprob, "bytes": raw}
    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in top_tokens(t)[:top_n]]}
                        for t in tokens if not t.special]}


def completion_logprobs(vocab: Vocab, tokens: list[Token], top_n: int, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        if t.special:
            continue
        text = vocab.get(t.id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({vocab.get(a.id)[0]: a.logprob for a in top_tokens(t)[:top_n]} if top_n else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def usage(job: Job) -> dict:
    prompt, completion = len(job.request.prompt_ids), len(job.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---- routes ----------------------------------------------------------------------------------------------------

def install_openai_routes(app: FastAPI, svc: Service) -> None:
    started = int(time.time())
    vocab = Vocab(svc.tokenizer)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request, exc: OpenAIError):
        return openai_error(exc.status, exc.message, exc.kind, exc.param)

    def model_name() -> str:
        return str(svc.info.get("model_id", "cb"))

    def fingerprint() -> str:
        return f"cb-{svc.info.get('version', '0')}"

    def model_card() -> dict:
        return {"id": model_name(), "object": "model", "created": started, "owned_by": "cb",
                "max_model_len": svc.info.get("max_total_tokens")}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model != model_name():
            raise OpenAIError(404, f"The model `{model}` does not exist", "model_not_found", "model")
        return model_card()

    async def run(job: Job, http: HttpRequest) -> None:
        """Follows a non-streamed job to its end; an error or a vanished client becomes an OpenAIError."""
        async for kind, payload in svc.events(job, http):
            if kind == "error":
                raise OpenAIError(424, payload, "generation")
        if job.finish_reason is None:
            raise OpenAIError(499, "client closed the request", "cancelled")

    async def stream(job: Job, stop: list[str], kind_of: tuple[str, str], chunk, with_logprobs: bool,
                     include_usage: bool, first: Optional[dict] = None):
        """SSE for a streamed job: `chunk(delta_text, tokens, finish_reason)` shapes each choice; `kind_of` is
        (id prefix, object)."""
        base = {"id": job_id(job, kind_of[0]), "object": kind_of[1], "created": int(time.time()),
                "model": model_name(), "system_fingerprint": fingerprint()}
        text = TextStream(stop)
        if first is not None:
            yield sse({**base, "choices": [first]})
        async for kind, payload in svc.events(job):
            if kind == "error":
                yield sse(_error_body(424, payload, "generation"))
            elif kind == "token":
                delta = text.push(payload, job.finish_reason is not None)
                if delta or (with_logprobs and not payload.special):
                    yield sse({**base, "choices": [chunk(delta, [payload], None)]})
            elif kind == "end":
                yield sse({**base, "choices": [chunk("", [], FINISH_REASONS.get(job.finish_reason, "stop"))]})
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(job)})
        yield "data: [DONE]\n\n"

    def job_id(job: Job, prefix: str) -> str:
        return f"{prefix}-{job.id}-{uuid.uuid4().hex[:12]}"

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: HttpRequest):
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= (most := max_top_logprobs(svc, "chat")):
                raise invalid(f"`top_logprobs` must be in [0, {most}]", "top_logprobs")
            if req.top_logprobs and not req.logprobs:
                raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_parameters(req, max_tokens, top_n)
        job = start(svc, chat_prompt(svc, req), params, "messages")

        if req.stream:
            def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                return {"index": 0, "delta": {"content": delta} if delta or not finish else {},
                        "logprobs": chat_logprobs(vocab, tokens, top_n) if req.logprobs and tokens else None,
                        "finish_reason": finish}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, params.stop, ("chatcmpl", "chat.completion.chunk"), chunk,
                                            bool(req.logprobs), include_usage, first), media_type="text/event-stream")

        await run(job, http)
        choice = {"index": 0, "message": {"role": "assistant", "content": cut_at_stop(svc.text(job), params.stop)},
                  "logprobs": chat_logprobs(vocab, job.tokens, top_n) if req.logprobs else None,
                  "finish_reason": FINISH_REASONS.get(job.finish_reason, "stop")}
        return JSONResponse({"id": job_id(job, "chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                             "model": model_name(), "choices": [choice], "usage": usage(job),
                             "system_fingerprint": fingerprint()})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HttpRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= (most := max_top_logprobs(svc, "completions")):
            raise invalid(f"`logprobs` must be in [0, {most}]", "logprobs")
        top_n = req.logprobs or 0
        params = to_parameters(req, req.max_tokens, top_n)
        prompt = completion_prompt(req)
        job = start(svc, prompt, params, "prompt")
        echo = (prompt if isinstance(prompt, str) else svc.tokenizer.decode(prompt)) if req.echo else ""

        if req.stream:
            offset = [len(echo)]

            def chunk(delta: str, tokens: list[Token], finish: Optional[str]) -> dict:
                logprobs = None
                if req.logprobs is not None and tokens:
                    logprobs = completion_logprobs(vocab, tokens, top_n, offset[0])
                    offset[0] += sum(len(t) for t in logprobs["tokens"])
                return {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            first = {"index": 0, "text": echo, "logprobs": None, "finish_reason": None} if echo else None
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, params.stop, ("cmpl", "text_completion"), chunk,
                                            req.logprobs is not None, include_usage, first),
                                     media_type="text/event-stream")

        await run(job, http)
        choice = {"index": 0, "text": echo + cut_at_stop(svc.text(job), params.stop),
                  "logprobs": completion_logprobs(vocab, job.tokens, top_n) if req.logprobs is not None else None,
                  "finish_reason": FINISH_REASONS.get(job.finish_reason, "stop")}
        return JSONResponse({"id": job_id(job, "cmpl"), "object": "text_completion", "created": int(time.time()),
                             "model": model_name(), "choices": [choice], "usage": usage(job),
                             "system_fingerprint": fingerprint()})
