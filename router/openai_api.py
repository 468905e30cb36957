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
from typing import Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from router.job import Job, Token
from router.openai_schemas import (FINISH_REASONS, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                   error_body, chat_prompt, completion_prompt, invalid, max_top_logprobs,
                                   openai_error, to_parameters)
from router.service import APIError, Service
from router.validation import GenerateRequest, Parameters

async def start(svc: Service, inputs, parameters: Parameters, prompt_field: str) -> Job:
    """svc.start, with TGI's field names in validation messages renamed to this API's."""
    try:
        return await svc.start(GenerateRequest(inputs=inputs, parameters=parameters))
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
                yield sse(error_body(424, payload, "generation"))
            elif kind == "token":
                delta = text.push(payload, payload.final)
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
        job = await start(svc, chat_prompt(svc, req), params, "messages")

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
        job = await start(svc, prompt, params, "prompt")
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
