"""TGI's routes: /generate, /generate_stream, / (compat), /tokenize, /health, /info and /metrics."""
import asyncio
import json

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import metrics
from router.api.errors import APIError, error_body
from router.api.info import Info
from router.api.service import Service
from router.api.validation import GenerateRequest
from router.detokenizer import json_logprob
from router.job import Job, Token

RETRY_AFTER = 5  # s a client is told to wait while the server is degraded or draining


def token_json(t: Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": json_logprob(t.logprob), "special": t.special}


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
        out["prefill"] = [{"id": i, "text": svc.tokenizer.decode([i]), "logprob": json_logprob(lp)}
                          for i, lp in zip(ids, job.prefill_logprobs)]
    out["tokens"] = [token_json(t) for t in job.tokens]
    if body.parameters.top_n_tokens:
        out["top_tokens"] = [[token_json(x) for x in t.top_tokens] for t in job.tokens]
    return out


def sse(obj: dict) -> str:
    return f"data:{json.dumps(obj)}\n\n"


def timing_headers(job: Job, svc: Service, body: GenerateRequest) -> dict:
    """TGI's x-* headers (durations in milliseconds), split as its metrics are (router/metrics.py): validation, queue
    (to the first scheduled step), inference (from it)."""
    end = job.finished_at or job.queued_at
    first = job.scheduled_at or end
    ms = lambda s: str(int(s * 1000))  # noqa: E731
    return {
        "x-compute-type": svc.info.model_device_type if svc.info else "cpu",
        "x-compute-time": f"{end - job.queued_at:.6f}",
        "x-compute-characters": str(len(body.inputs) if isinstance(body.inputs, str) else 0),
        "x-total-time": ms(end - job.arrived_at), "x-validation-time": ms(job.queued_at - job.arrived_at),
        "x-queue-time": ms(first - job.queued_at), "x-inference-time": ms(end - first),
        "x-time-per-token": ms((end - first) / max(1, len(job.tokens))),
        "x-prompt-tokens": str(len(job.request.prompt_ids)), "x-generated-tokens": str(len(job.tokens)),
    }


def unhealthy(message: str) -> JSONResponse:
    return JSONResponse(error_body(False, 503, message, "unhealthy"), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER)})


class TGIRoutes:
    def __init__(self, svc: Service):
        self.svc = svc

    def final_text(self, job: Job, body: GenerateRequest) -> str:
        text = self.svc.text(job)
        if body.parameters.return_full_text and isinstance(body.inputs, str):
            text = body.inputs + text
        return text

    async def generate_json(self, body: GenerateRequest, http: HttpRequest) -> tuple[dict, dict]:
        """One answer; with best_of > 1, that many sampled choices (seed + i each), the answer the most likely
        by cumulative logprob and the others in details.best_of_sequences, as TGI has it."""
        jobs = await self.svc.start_choices(body, body.parameters.best_of or 1)
        await self.svc.follow(jobs, http)
        best = max(jobs, key=lambda j: j.cumulative_logprob)
        out = {"generated_text": self.final_text(best, body)}
        if body.parameters.details:
            out["details"] = full_details_json(best, self.svc, body)
            if len(jobs) > 1:
                out["details"]["best_of_sequences"] = [
                    {"generated_text": self.final_text(j, body), **full_details_json(j, self.svc, body)}
                    for j in jobs if j is not best]
        return out, timing_headers(best, self.svc, body)

    async def stream_response(self, body: GenerateRequest) -> StreamingResponse:
        if (body.parameters.best_of or 1) > 1:
            raise APIError(422, "`best_of` != 1 is not supported when streaming tokens", "validation")
        job = await self.svc.start(body)

        async def stream():
            index = 0
            async for kind, payload in self.svc.events(job):
                if kind == "error":
                    yield sse(error_body(False, 424, payload, "generation"))
                elif kind == "token":
                    index += 1
                    last = payload.final
                    top = [token_json(t) for t in payload.top_tokens] if body.parameters.top_n_tokens else None
                    yield sse({
                        "index": index, "token": token_json(payload), "top_tokens": top,
                        "generated_text": self.final_text(job, body) if last else None,
                        "details": details_json(job) if last else None,
                    })

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def generate(self, body: GenerateRequest, http: HttpRequest):
        out, headers = await self.generate_json(body, http)
        return JSONResponse(out, headers=headers)

    async def generate_stream(self, body: GenerateRequest):
        return await self.stream_response(body)

    async def compat_generate(self, body: GenerateRequest, http: HttpRequest):
        """TGI's compat route: `stream` picks SSE; otherwise a JSON list of one response."""
        if body.stream:
            return await self.stream_response(body)
        out, headers = await self.generate_json(body, http)
        return JSONResponse([out], headers=headers)

    async def tokenize(self, body: GenerateRequest):
        """Tokenized and serialized in a worker thread, as Service.start tokenizes: a long text (up to
        --payload-limit) never stalls the batching loop."""
        if not isinstance(body.inputs, str) or not body.inputs:
            raise APIError(422, "`inputs` must be a non-empty string", "validation")

        def tokens() -> bytes:
            enc = self.svc.tokenizer(body.inputs, return_offsets_mapping=True)
            return json.dumps([{"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
                               for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]).encode()
        return Response(await asyncio.to_thread(tokens), media_type="application/json")

    async def health(self):
        """200 only while every shard answered recently and nothing is being replaced or drained; else 503 with
        Retry-After. The engine's own calls (steps, or Health every few seconds while idle) keep this current."""
        engine = self.svc.engine
        if self.svc.draining:
            return unhealthy("the server is shutting down")
        if engine.recovering:
            return unhealthy("a shard failed: the shard set is being replaced and requests will resume")
        if not engine.healthy:
            return unhealthy(f"a shard has not answered for {engine.shards.deadline.silent_for:.0f} s")
        return JSONResponse({})

    async def info(self) -> Info:
        return await self.svc.current_info()

    async def model_info(self):
        """SGLang's /model_info, which sglang-router reads when a worker registers (to name its model)."""
        return {"model_path": self.svc.model_name, "tokenizer_path": None, "is_generation": True,
                "served_model_name": self.svc.model_name}

    async def server_info(self):
        """SGLang's /server_info, as sglang-router reads it at registration: the model, parallelism, capacity."""
        info = await self.svc.current_info()
        return {"model_path": info.model_id, "served_model_name": info.model_id, "tp_size": info.num_shard,
                "dp_size": 1, "max_total_num_tokens": info.max_batch_total_tokens,
                "max_running_requests": info.max_batch_size, "version": info.version}

    async def prometheus(self):
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def install_tgi_routes(app: FastAPI, svc: Service) -> None:
    routes = TGIRoutes(svc)
    app.post("/generate")(routes.generate)
    app.post("/generate_stream")(routes.generate_stream)
    app.post("/")(routes.compat_generate)
    app.post("/tokenize")(routes.tokenize)
    app.get("/health")(routes.health)
    app.get("/info", response_model=Info)(routes.info)
    app.get("/metrics")(routes.prometheus)
    for path in ("/model_info", "/get_model_info"):  # SGLang's names (and their older ones) for replicas behind
        app.get(path, include_in_schema=False)(routes.model_info)  # sglang-router (docs/operations.md)
    for path in ("/server_info", "/get_server_info"):
        app.get(path, include_in_schema=False)(routes.server_info)
