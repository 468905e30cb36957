"""The HTTP API (TGI's shape): /generate, /generate_stream (SSE), /health, /info."""
import json
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import metrics

from router.detokenizer import Detokenizer
from router.engine import Engine
from router.job import Job, Token
from router.request import Request
from router.validation import GenerateRequest, Limits, ValidationError, validate


@dataclass
class Context:
    engine: Engine
    tokenizer: object
    limits: Limits
    eos_ids: frozenset
    max_concurrent_requests: int
    info: dict
    draining: bool = False


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": kind}, status_code=status)


def token_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def details_json(job: Job) -> dict:
    return {
        "finish_reason": job.finish_reason,
        "generated_tokens": len(job.tokens),
        "seed": job.seed,
        "input_length": len(job.request.prompt_ids),
    }


def install_routes(app: FastAPI, ctx: Context) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        metrics.outcomes.labels("validation").inc()
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(422, f"{where}: {first.get('msg', 'invalid request')}".lstrip(": "), "validation")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        kind = "validation" if exc.status_code in (400, 422) else "http"
        return error(exc.status_code, str(exc.detail), kind)

    def start(body: GenerateRequest):
        metrics.requests.inc()
        if ctx.draining:
            metrics.outcomes.labels("unhealthy").inc()
            return error(503, "the server is shutting down", "unhealthy")
        if len(ctx.engine.jobs) >= ctx.max_concurrent_requests:
            metrics.outcomes.labels("overloaded").inc()
            return error(429, "Model is overloaded", "overloaded")
        try:
            v = validate(body, ctx.tokenizer, ctx.limits)
        except ValidationError as e:
            metrics.outcomes.labels("validation").inc()
            return error(422, str(e), "validation")
        eos = frozenset() if body.parameters.ignore_eos else ctx.eos_ids
        job = Job(
            request=Request(prompt_ids=v.input_ids, max_new_tokens=v.max_new_tokens),
            parameters=v.sampling,
            detokenizer=Detokenizer(ctx.tokenizer, v.input_ids[-5:], v.stop),
            eos_ids=eos, special_ids=frozenset(ctx.tokenizer.all_special_ids), seed=v.seed,
        )
        ctx.engine.submit(job)
        return job

    def final_text(job: Job, body: GenerateRequest) -> str:
        text = ctx.tokenizer.decode(job.request.generated, skip_special_tokens=True)
        if body.parameters.return_full_text and isinstance(body.inputs, str):
            text = body.inputs + text
        return text

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: HttpRequest):
        job = start(body)
        if isinstance(job, JSONResponse):
            return job
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "error":
                    return error(424, payload, "generation")
                if kind == "end":
                    break
        finally:
            ctx.engine.cancel(job)
        out = {"generated_text": final_text(job, body)}
        if body.parameters.details:
            out["details"] = {**details_json(job), "tokens": [token_json(t) for t in job.tokens]}
        return JSONResponse(out, headers=timing_headers(job))

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest):
        job = start(body)
        if isinstance(job, JSONResponse):
            return job

        async def events():
            try:
                index = 0
                while True:
                    kind, payload = await job.events.get()
                    if kind == "error":
                        yield sse({"error": payload, "error_type": "generation"})
                        return
                    if kind == "token":
                        index += 1
                        last = job.finish_reason is not None and job.events.qsize() == 1
                        yield sse({
                            "index": index, "token": token_json(payload), "top_tokens": None,
                            "generated_text": final_text(job, body) if last else None,
                            "details": details_json(job) if last else None,
                        })
                    if kind == "end":
                        return
            finally:
                ctx.engine.cancel(job)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if ctx.draining:
            return error(503, "the server is shutting down", "unhealthy")
        return JSONResponse({})

    @app.get("/info")
    async def info():
        return ctx.info

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def sse(obj: dict) -> str:
    return f"data:{json.dumps(obj)}\n\n"


def timing_headers(job: Job) -> dict:
    total = (job.finished_at or job.queued_at) - job.queued_at
    first = (job.first_token_at or job.queued_at) - job.queued_at
    per_token = (total - first) / max(1, len(job.tokens) - 1)
    return {
        "x-compute-time": f"{total:.6f}", "x-time-per-token": f"{per_token * 1000:.3f}",
        "x-queue-time": f"{first * 1000:.3f}", "x-generated-tokens": str(len(job.tokens)),
    }
