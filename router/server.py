"""The HTTP app: TGI's routes (/generate, /generate_stream, /health, /info, /metrics) and error shape."""
import asyncio
import json

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import metrics
from router.job import Job, Token
from router.openai_api import install_openai_routes
from router.openai_schemas import openai_error
from router.service import APIError, Service
from router.shards import ShardError
from router.validation import GenerateRequest


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": kind}, status_code=status)


def error_for(request: HttpRequest, status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error shape on its routes (/v1/...), TGI's everywhere else."""
    if request.url.path.startswith("/v1/"):
        return openai_error(status, message, kind)
    return error(status, message, kind)


def token_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def details_json(job: Job) -> dict:
    return {
        "finish_reason": job.finish_reason,
        "generated_tokens": len(job.tokens),
        "seed": job.seed,
        "input_length": len(job.request.prompt_ids),
    }


def full_details_json(job: Job, svc: Service, body: GenerateRequest) -> dict:
    out = {k: v for k, v in details_json(job).items() if k != "input_length"}
    out["prefill"] = []
    if body.parameters.decoder_input_details:
        ids = job.request.prompt_ids
        out["prefill"] = [{"id": i, "text": svc.tokenizer.decode([i]), "logprob": None if lp != lp else lp}
                          for i, lp in zip(ids, job.prefill_logprobs)]
    out["tokens"] = [token_json(t) for t in job.tokens]
    if body.parameters.top_n_tokens:
        out["top_tokens"] = [[token_json(x) for x in t.top_tokens] for t in job.tokens]
    return out


def sse(obj: dict) -> str:
    return f"data:{json.dumps(obj)}\n\n"


def timing_headers(job: Job, svc: Service, body: GenerateRequest) -> dict:
    """TGI's x-* headers (durations in milliseconds)."""
    end = job.finished_at or job.queued_at
    first = job.first_token_at or end
    ms = lambda s: str(int(s * 1000))  # noqa: E731
    return {
        "x-compute-type": svc.info.get("model_device_type", "cpu"),
        "x-compute-time": f"{end - job.queued_at:.6f}",
        "x-compute-characters": str(len(body.inputs) if isinstance(body.inputs, str) else 0),
        "x-total-time": ms(end - job.arrived_at), "x-validation-time": ms(job.queued_at - job.arrived_at),
        "x-queue-time": ms(first - job.queued_at), "x-inference-time": ms(end - first),
        "x-time-per-token": ms((end - job.queued_at) / max(1, len(job.tokens))),
        "x-prompt-tokens": str(len(job.request.prompt_ids)), "x-generated-tokens": str(len(job.tokens)),
    }


def install_routes(app: FastAPI, svc: Service) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        metrics.outcomes.labels("validation").inc()
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_for(request, 422, f"{where}: {first.get('msg', 'invalid request')}".lstrip(": "), "validation")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        kind = {400: "validation", 422: "validation", 413: "payload_too_large"}.get(exc.status_code, "http")
        return error_for(request, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        return error_for(request, exc.status, exc.message, exc.kind)

    def final_text(job: Job, body: GenerateRequest) -> str:
        text = svc.text(job)
        if body.parameters.return_full_text and isinstance(body.inputs, str):
            text = body.inputs + text
        return text

    async def generate_json(body: GenerateRequest, http: HttpRequest):
        job = await svc.start(body)
        async for kind, payload in svc.events(job, http):
            if kind == "error":
                raise APIError(424, payload, "generation")
        if job.finish_reason is None:
            raise APIError(499, "client closed the request", "cancelled")
        out = {"generated_text": final_text(job, body)}
        if body.parameters.details:
            out["details"] = full_details_json(job, svc, body)
        return out, timing_headers(job, svc, body)

    async def stream_response(body: GenerateRequest) -> StreamingResponse:
        job = await svc.start(body)

        async def stream():
            index = 0
            async for kind, payload in svc.events(job):
                if kind == "error":
                    yield sse({"error": payload, "error_type": "generation"})
                elif kind == "token":
                    index += 1
                    last = payload.final
                    top = [token_json(t) for t in payload.top_tokens] if body.parameters.top_n_tokens else None
                    yield sse({
                        "index": index, "token": token_json(payload), "top_tokens": top,
                        "generated_text": final_text(job, body) if last else None,
                        "details": details_json(job) if last else None,
                    })

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: HttpRequest):
        out, headers = await generate_json(body, http)
        return JSONResponse(out, headers=headers)

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest):
        return await stream_response(body)

    @app.post("/")
    async def compat_generate(body: GenerateRequest, http: HttpRequest):
        """TGI's compat route: `stream` picks SSE; otherwise a JSON list of one response."""
        if body.stream:
            return await stream_response(body)
        out, headers = await generate_json(body, http)
        return JSONResponse([out], headers=headers)

    @app.post("/tokenize")
    async def tokenize(body: GenerateRequest):
        if not isinstance(body.inputs, str) or not body.inputs:
            raise APIError(422, "`inputs` must be a non-empty string", "validation")
        enc = svc.tokenizer(body.inputs, return_offsets_mapping=True)
        return [{"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
                for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]

    @app.get("/health")
    async def health():
        if svc.draining:
            return error(503, "the server is shutting down", "unhealthy")
        if svc.engine.last_step_failed:
            return error(503, "the last step failed on a shard", "unhealthy")
        if not svc.engine.busy:  # while steps run they prove the shards alive; a Health call would queue behind
            try:
                await asyncio.wait_for(svc.engine.shards.health(), timeout=5)
            except (ShardError, asyncio.TimeoutError) as e:
                return error(503, f"a shard is unhealthy: {e}", "unhealthy")
        return JSONResponse({})

    @app.get("/info")
    async def info():
        return svc.info

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    install_openai_routes(app, svc)
