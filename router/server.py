"""The HTTP app: TGI's routes (/generate, /generate_stream, /health, /info, /metrics) and error shape."""
import json

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import metrics
from router.job import Job, Token
from router.openai_api import install_openai_routes, openai_error
from router.service import APIError, Service
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


def install_routes(app: FastAPI, svc: Service) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        metrics.outcomes.labels("validation").inc()
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_for(request, 422, f"{where}: {first.get('msg', 'invalid request')}".lstrip(": "), "validation")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        kind = "validation" if exc.status_code in (400, 422) else "http"
        return error_for(request, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        return error_for(request, exc.status, exc.message, exc.kind)

    def final_text(job: Job, body: GenerateRequest) -> str:
        text = svc.text(job)
        if body.parameters.return_full_text and isinstance(body.inputs, str):
            text = body.inputs + text
        return text

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: HttpRequest):
        job = svc.start(body)
        async for kind, payload in svc.events(job, http):
            if kind == "error":
                return error(424, payload, "generation")
        if job.finish_reason is None:
            return error(499, "client closed the request", "cancelled")
        out = {"generated_text": final_text(job, body)}
        if body.parameters.details:
            out["details"] = {**details_json(job), "tokens": [token_json(t) for t in job.tokens]}
        return JSONResponse(out, headers=timing_headers(job))

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest):
        job = svc.start(body)

        async def stream():
            index = 0
            async for kind, payload in svc.events(job):
                if kind == "error":
                    yield sse({"error": payload, "error_type": "generation"})
                elif kind == "token":
                    index += 1
                    last = job.finish_reason is not None and job.events.qsize() == 1
                    yield sse({
                        "index": index, "token": token_json(payload), "top_tokens": None,
                        "generated_text": final_text(job, body) if last else None,
                        "details": details_json(job) if last else None,
                    })

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if svc.draining:
            return error(503, "the server is shutting down", "unhealthy")
        return JSONResponse({})

    @app.get("/info")
    async def info():
        return svc.info

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    install_openai_routes(app, svc)
