"""Prometheus metrics under TGI's `tgi_*` names, plus the KV pools (`cb_*`), read by GET /metrics, and the few
functions the engine calls to record a step, its block moves, the pools and each retired request."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

registry = CollectorRegistry()

requests = Counter("tgi_request_count", "Requests received", registry=registry)
outcomes = Counter("tgi_request_outcome", "Requests by outcome", ["outcome"], registry=registry)
generated_tokens = Histogram("tgi_request_generated_tokens", "Generated tokens per request",
                             buckets=[1, 8, 32, 64, 128, 256, 512, 1024, 2048], registry=registry)
request_duration = Histogram("tgi_request_duration", "End-to-end request seconds", registry=registry,
                             buckets=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300])
validation_duration = Histogram("tgi_request_validation_duration", "Validation seconds", registry=registry,
                                buckets=[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1])
input_length = Histogram("tgi_request_input_length", "Prompt tokens per request", registry=registry,
                         buckets=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096])
inference_duration = Histogram("tgi_request_inference_duration", "Seconds from first scheduled step to the end",
                               registry=registry, buckets=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300])
time_per_token = Histogram("tgi_request_mean_time_per_token_duration", "Mean seconds per generated token",
                           registry=registry, buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
queue_duration = Histogram("tgi_request_queue_duration", "Seconds from arrival to first token",
                           registry=registry, buckets=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])
forward_duration = Histogram("tgi_batch_forward_duration", "Shard forward seconds per step", ["method"],
                             registry=registry, buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
router_step = Histogram("cb_router_step_seconds", "The router's own work between two steps: planning one and "
                        "applying the last one's tokens to their requests (text, stop sequences and streams are "
                        "done while the next step computes)", registry=registry,
                        buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05])
step_gap = Histogram("cb_step_gap_seconds", "Shard idle time between a step's answer and the next step's call while "
                     "requests run (the router's work and its other shard calls)", registry=registry,
                     buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1])
forward_steps = Counter("cb_forward_steps", "Forward passes by how they ran: compiled (a step size compiled at "
                        "start-up, --compile-sizes) or eager", ["path"], registry=registry)
batch_size = Gauge("tgi_batch_current_size", "Requests in the running batch", registry=registry)
queue_size = Gauge("tgi_queue_size", "Requests waiting", registry=registry)
preemptions = Counter("cb_preemptions", "Requests soft-reset to free KV blocks", registry=registry)
offloads = Counter("cb_offloads", "Requests offloaded to the host swap pool", registry=registry)
restores = Counter("cb_restores", "Offloaded requests restored without recomputation", registry=registry)
offloaded_blocks = Counter("cb_offloaded_blocks", "KV blocks copied to the host swap pool", registry=registry)
restored_blocks = Counter("cb_restored_blocks", "KV blocks copied back from the host swap pool", registry=registry)
offloaded_requests = Gauge("cb_offloaded_requests", "Requests waiting in the host swap pool", registry=registry)
swap_free = Gauge("cb_swap_blocks_free", "Free slots of the host swap pool", registry=registry)
swap_total = Gauge("cb_swap_blocks_total", "Slots of the host swap pool", registry=registry)
window_blocks_free = Gauge("cb_window_blocks_free", "Free blocks of the sliding-window layers' pool",
                           registry=registry)
window_blocks_total = Gauge("cb_window_blocks_total", "Blocks of the sliding-window layers' pool", registry=registry)
prefill_chunks = Counter("cb_prefill_chunks", "Prompt chunks that stopped short of the prompt's end",
                         registry=registry)
shard_restarts = Counter("cb_shard_restarts", "Shard sets replaced after a shard died, hung or missed a deadline",
                         registry=registry)
blocks_free = Gauge("cb_kv_blocks_free", "Free KV blocks", registry=registry)
blocks_total = Gauge("cb_kv_blocks_total", "KV blocks in the pool", registry=registry)
computed_tokens = Counter("cb_computed_tokens", "Tokens the shards computed (prompt and decode)", registry=registry)
prefix_lookups = Counter("cb_prefix_cache_lookups", "Admissions that looked up the prefix cache", registry=registry)
prefix_hit_blocks = Counter("cb_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache",
                            registry=registry)
prefix_hit_tokens = Counter("cb_prefix_cache_hit_tokens", "Prompt tokens not recomputed thanks to the prefix cache",
                            registry=registry)


def observe_step(step, resp) -> None:
    computed_tokens.inc(resp.tokens)
    prefill_chunks.inc(sum(1 for e in step.entries if not e.decode and not e.sample))
    forward_duration.labels("prefill" if step.has_prefill else "decode").observe(resp.forward_ns / 1e9)
    forward_steps.labels("compiled" if resp.compiled else "eager").inc()


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


def observe_retired(job) -> None:
    """A request that left: cancelled by its client, or finished with its timings."""
    if job.finish_reason is None:
        outcomes.labels("cancelled").inc()
        return
    outcomes.labels("success").inc()
    generated_tokens.observe(len(job.tokens))
    request_duration.observe(job.finished_at - job.queued_at)
    queue_duration.observe(job.first_token_at - job.queued_at)
    inference_duration.observe(job.finished_at - job.first_token_at)
    time_per_token.observe((job.finished_at - job.queued_at) / max(1, len(job.tokens)))
