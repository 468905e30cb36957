"""Prometheus metrics under TGI's `tgi_*` names, meaning what TGI's router means by them, plus cb's own (`cb_*`: the
KV pools, the steps), read by GET /metrics, and the few functions the engine calls to record a planned step, its
answer, its block moves, the pools and each retired request."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

registry = CollectorRegistry()

requests = Counter("tgi_request_count", "Generation requests received, counted on arrival before any check",
                   registry=registry)
_outcomes = Counter("tgi_request_outcome", "cb: requests by how they ended (success, cancelled, error, validation, "
                    "overloaded, unhealthy); TGI's own pair is tgi_request_success and tgi_request_failure{err}",
                    ["outcome"], registry=registry)
success = Counter("tgi_request_success", "Requests that ended with their result (the last token sent)",
                  registry=registry)
failure = Counter("tgi_request_failure", "Requests that ended without a result, by TGI's err: validation, "
                  "overloaded, dropped (the client went away), generation (a step or the shards failed), and cb's "
                  "unhealthy (refused while shutting down)", ["err"], registry=registry)
TGI_ERR = {"cancelled": "dropped", "error": "generation"}  # cb's outcome -> TGI's err; the others keep their name
generated_tokens = Histogram("tgi_request_generated_tokens", "Tokens generated per successful request",
                             buckets=[1, 8, 32, 64, 128, 256, 512, 1024, 2048], registry=registry)
request_duration = Histogram("tgi_request_duration", "Seconds from a successful request's arrival (before "
                             "validation) to its last token", registry=registry,
                             buckets=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300])
validation_duration = Histogram("tgi_request_validation_duration", "Seconds from a request's arrival to its place "
                                "in the queue: admission checks, tokenization, validation", registry=registry,
                                buckets=[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1])
max_new_tokens = Histogram("tgi_request_max_new_tokens", "max_new_tokens per validated request (what it asked for, "
                           "or the default: --max-total-tokens less its prompt)", registry=registry,
                           buckets=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096])
input_length = Histogram("tgi_request_input_length", "Prompt tokens per validated request", registry=registry,
                         buckets=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096])
queue_duration = Histogram("tgi_request_queue_duration", "Seconds a successful request waited in the queue: from "
                           "joining it (after validation) to its first scheduled step. A request soft-reset or "
                           "resumed after a shard restart keeps that first step; its later waits are inference",
                           registry=registry, buckets=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])
inference_duration = Histogram("tgi_request_inference_duration", "Seconds from a successful request's first "
                               "scheduled step to its last token (waits after a soft reset or a shard restart "
                               "included)", registry=registry,
                               buckets=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300])
time_per_token = Histogram("tgi_request_mean_time_per_token_duration", "A successful request's inference seconds "
                           "(tgi_request_inference_duration) per token it generated", registry=registry,
                           buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
forward_duration = Histogram("tgi_batch_forward_duration", "Seconds of a step's forward pass and sampling, as the "
                             "first shard timed them, by method: prefill (a step with prompt tokens: the Prefill "
                             "call) or decode", ["method"], registry=registry,
                             buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
inference_count = Counter("tgi_batch_inference_count", "Steps the router started, by method (prefill or decode); "
                          "those the shards answered are tgi_batch_inference_success", ["method"], registry=registry)
inference_success = Counter("tgi_batch_inference_success", "Steps the shards answered, by method (prefill or "
                            "decode)", ["method"], registry=registry)
next_size = Histogram("tgi_batch_next_size", "Requests a step takes from the queue (their first step since they "
                      "joined it)", registry=registry, buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256])
router_step = Histogram("cb_router_step_seconds", "The router's own work between two steps: planning one and "
                        "applying the last one's tokens to their requests (text, stop sequences and streams are "
                        "done while the next step computes)", registry=registry,
                        buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05])
step_gap = Histogram("cb_step_gap_seconds", "Shard idle time between a step's answer and the next step's call while "
                     "requests run (the router's work and its other shard calls)", registry=registry,
                     buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1])
forward_steps = Counter("cb_forward_steps", "Forward passes by how they ran: compiled (a step size compiled for "
                        "--compile-sizes) or eager", ["path"], registry=registry)
batch_size = Gauge("tgi_batch_current_size", "Requests in the running batch (holding KV blocks on the device), set "
                   "before each step; 0 while idle", registry=registry)
batch_max_tokens = Gauge("tgi_batch_current_max_tokens", "Tokens the running batch holds in the KV cache, what "
                         "counts against --max-batch-total-tokens (TGI: the tokens its batch reserved), set before "
                         "each step", registry=registry)
queue_size = Gauge("tgi_queue_size", "Requests waiting for a step: new ones, and those soft-reset or waiting to "
                   "resume after a shard restart (offloaded ones: cb_offloaded_requests), set before each step",
                   registry=registry)
preemptions = Counter("cb_preemptions", "Soft resets to free KV blocks (a request may be reset more than once; "
                      "a shard restart's resets are not counted here)", registry=registry)
offloads = Counter("cb_offloads", "Requests offloaded to the host swap pool (each time)", registry=registry)
restores = Counter("cb_restores", "Offloaded requests restored without recomputation (each time)", registry=registry)
offloaded_blocks = Counter("cb_offloaded_blocks", "KV blocks copied to the host swap pool", registry=registry)
restored_blocks = Counter("cb_restored_blocks", "KV blocks copied back from the host swap pool", registry=registry)
offloaded_requests = Gauge("cb_offloaded_requests", "Requests waiting in the host swap pool", registry=registry)
swap_free = Gauge("cb_swap_blocks_free", "Free slots of the host swap pool", registry=registry)
swap_total = Gauge("cb_swap_blocks_total", "Slots of the host swap pool", registry=registry)
window_blocks_free = Gauge("cb_window_blocks_free", "Free blocks of the sliding-window layers' pool",
                           registry=registry)
window_blocks_total = Gauge("cb_window_blocks_total", "Blocks of the sliding-window layers' pool", registry=registry)
prefill_chunks = Counter("cb_prefill_chunks", "Prompt chunks (of a prompt, or of a soft-reset request's history) "
                         "that stopped short of its end", registry=registry)
shard_restarts = Counter("cb_shard_restarts", "Shard sets replaced after a shard died, hung or missed a deadline",
                         registry=registry)
blocks_free = Gauge("cb_kv_blocks_free", "Free KV blocks", registry=registry)
blocks_total = Gauge("cb_kv_blocks_total", "KV blocks in the pool", registry=registry)
computed_tokens = Counter("cb_computed_tokens", "Tokens the shards' forward passes took in: prompt chunks (a "
                          "soft-reset request's history again) and decodes", registry=registry)
prefix_lookups = Counter("cb_prefix_cache_lookups", "Admissions that looked up the prefix cache", registry=registry)
prefix_hit_blocks = Counter("cb_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache",
                            registry=registry)
prefix_hit_tokens = Counter("cb_prefix_cache_hit_tokens", "Prompt tokens not recomputed thanks to the prefix cache",
                            registry=registry)


def outcome(name: str, count: int = 1) -> None:
    """`count` requests ended (success, cancelled, error, validation, overloaded, unhealthy): counted under cb's
    tgi_request_outcome and under TGI's tgi_request_success or tgi_request_failure{err} alike."""
    _outcomes.labels(name).inc(count)
    if name == "success":
        success.inc(count)
    else:
        failure.labels(TGI_ERR.get(name, name)).inc(count)


def _method(step) -> str:
    """TGI's method label: the shard call the step makes (router/shards.py: Prefill when it carries prompt tokens)."""
    return "prefill" if step.has_prefill else "decode"


def observe_planned(step, jobs) -> None:
    """A step as planned, before it runs. A request's first step since it joined the queue is TGI's batch_time:
    the first one ends its queue time (a soft reset or a shard restart does not start it again); those requests
    are the batch TGI calls next."""
    taken = [e.request.id for e in step.entries if e.first]
    for i in taken:
        jobs[i].on_scheduled()
    if taken:
        next_size.observe(len(taken))
    if step.entries:
        inference_count.labels(_method(step)).inc()


def observe_step(step, resp) -> None:
    """A step the shards answered."""
    computed_tokens.inc(resp.tokens)
    prefill_chunks.inc(sum(1 for e in step.entries if not e.decode and not e.sample))
    forward_duration.labels(_method(step)).observe(resp.forward_ns / 1e9)
    forward_steps.labels("compiled" if resp.compiled else "eager").inc()
    inference_success.labels(_method(step)).inc()


def observe_moves(step) -> None:
    preemptions.inc(len(step.preempted))
    offloads.inc(len(step.offloaded))
    offloaded_blocks.inc(len(step.to_cpu))
    restores.inc(len(step.restored))
    restored_blocks.inc(len(step.to_device))


def observe_prefix_hits(lookups: int, blocks: int, block_size: int) -> None:
    prefix_lookups.inc(lookups)
    prefix_hit_blocks.inc(blocks)
    prefix_hit_tokens.inc(blocks * block_size)


def observe_scheduler(s) -> None:
    """The queue, the batch and every pool, before each step."""
    batch_size.set(len(s.running))
    batch_max_tokens.set(s.held_tokens)
    queue_size.set(len(s.waiting))
    offloaded_requests.set(len(s.offloaded))
    kv = s.kv
    blocks_free.set(kv.pool.num_free)
    blocks_total.set(kv.pool.num_blocks)
    if kv.swap is not None:
        swap_free.set(kv.swap.num_free)
        swap_total.set(kv.swap.num_blocks)
    if kv.window is not None:
        window_blocks_free.set(kv.window.blocks.num_free)
        window_blocks_total.set(kv.window.blocks.num_blocks)


speculation_proposed = Counter("cb_speculation_proposed_tokens", "Draft tokens proposed by speculation (--speculate) "
                               "and verified", registry=registry)
speculation_accepted = Counter("cb_speculation_accepted_tokens", "Draft tokens the model accepted: each saved a step "
                               "of its request", registry=registry)
skipped_tokens = Histogram("tgi_request_skipped_tokens", "Tokens speculation gave a successful request beyond one "
                           "per step", buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=registry)


def observe_speculation(step, outcome) -> None:
    for e in step.entries:
        if e.drafts and e.request.id in outcome.tokens:
            speculation_proposed.inc(len(e.drafts))
            speculation_accepted.inc(min(len(e.drafts), len(outcome.more.get(e.request.id, []))))


def observe_retired(job) -> None:
    """A request that left: cancelled by its client, or finished with its timings, as TGI splits them: arrival,
    queued (validated), first scheduled step, last token."""
    if job.finish_reason is None:
        outcome("cancelled")
        return
    outcome("success")
    inference = job.finished_at - job.scheduled_at
    generated_tokens.observe(len(job.tokens))
    skipped_tokens.observe(job.skipped_tokens)
    request_duration.observe(job.finished_at - job.arrived_at)
    queue_duration.observe(job.scheduled_at - job.queued_at)
    inference_duration.observe(inference)
    time_per_token.observe(inference / max(1, len(job.tokens)))
