"""The sliding-window layers' own KV pool, driven directly on a shard's Runner (no gRPC, no processes).

A tiny random hybrid Gemma 3 (sliding and full layers, window 16, blocks of 4 tokens) is served by the router's
own scheduler and KV manager, two requests at once, their prompts chunked off block boundaries, the second joining
while the first still prefills; each step travels through the real message translations (router → proto → shard).
The window pool is sized by the shard's own formula and the router drops every window block that slid out of
the window. Greedy tokens must equal transformers' `generate` far beyond the window, and every prompt token's
logprob (scored in chunks) its full forward pass.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from proto import generate_pb2 as pb
from router.core.kv import KVManager
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.core.step import Outcome
from router.job import Job
from router.shards import entry_message
from shard import model as model_lib
from shard.kv_cache import ceil_div, size_pools
from shard.runner import Runner, StepError
from shard.sampling import Params
from shard.server import step_entry
from shard.step import Entry

WINDOW, BS, PREFILL, BATCH, BLOCKS = 16, 4, 14, 2, 64


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256, initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def runner(tiny_gemma):
    loaded = model_lib.load(str(tiny_gemma), "float32", torch.device("cpu"), 0, 1)
    runner = Runner(loaded, torch.device("cpu"), BS, 0, 1)
    runner.warmup(PREFILL)
    sizes = size_pools(loaded.sliding, loaded.sliding_window, BS, loaded.kv_heads, loaded.head_dim, torch.float32,
                       torch.device("cpu"), 1, num_blocks=BLOCKS, max_prefill_tokens=PREFILL, max_batch_size=BATCH,
                       max_total_tokens=128, memory_fraction=0.9, swap_bytes=0)
    runner.allocate(sizes.num_blocks, sizes.num_window_blocks)
    return runner


@pytest.fixture(scope="module")
def reference(tiny_gemma):
    return AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()


@torch.inference_mode()
def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    logprobs = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_pools_split_by_layer_type(runner):
    cache = runner.cache
    window_blocks = BATCH * (ceil_div(WINDOW - 1, BS) + 2) + ceil_div(PREFILL, BS)  # the bound size_pools explains
    assert (cache.num_blocks, cache.num_window_blocks) == (BLOCKS, window_blocks)
    assert cache.full.shape == (1, 2, 1, BLOCKS + 1, BS, 32)  # + the padding's scratch block
    assert cache.window.shape == (3, 2, 1, window_blocks + 1, BS, 32)
    assert [(p is cache.window, j) for p, j in cache.where] == [(True, 0), (True, 1), (False, 0), (True, 2)]


def test_greedy_beyond_the_window_equals_transformers(runner, reference):
    """Prompts of 3x and 2x the window in chunks of at most 14 tokens, the second arriving while the first still
    prefills; then decodes to 4x the window."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (3 * WINDOW,), generator=gen).tolist(),
               torch.randint(3, 256, (2 * WINDOW + 3,), generator=gen).tolist()]
    reqs = [Request(p, n, reuse_prefix=False) for p, n in zip(prompts, (20, 30))]
    kv = KVManager(BLOCKS, BS, window=WINDOW, window_blocks=runner.cache.num_window_blocks)
    sched = Scheduler(Budget(PREFILL, BLOCKS * BS, BATCH, 0.0, 0), kv)
    jobs = {r.id: Job(r, pb.SamplingParameters(prefill_logprobs=True), None, frozenset()) for r in reqs}
    scored: dict[int, list[float]] = {r.id: [] for r in reqs}
    sched.add(reqs[0])
    most_window_blocks, steps, slid, joined, unaligned = 0, 0, {r.id: 0 for r in reqs}, False, False
    while sched.busy or steps < 2:
        if steps == 2:
            sched.add(reqs[1])
        step = sched.schedule()
        most_window_blocks = max(most_window_blocks, kv.window.blocks.num_used)
        slid = {r.id: max(slid[r.id], r.window_base) for r in reqs}
        chunks = {e.request.id: not e.decode for e in step.entries}
        joined |= chunks.get(reqs[0].id, False) and reqs[1].id in chunks
        unaligned |= any(e.start % BS for e in step.entries if not e.decode)
        result = runner.step([step_entry(entry_message(e, jobs[e.request.id])) for e in step.entries])
        for rid, logprobs in result.prefill:
            scored[rid] += logprobs
        sched.update(step, Outcome({g.id: g.token_id for g in result.generations}))
        steps += 1
    assert all(slid.values()), "both window tables dropped blocks that slid out of the window"
    assert joined and unaligned, "the second prompt joins mid-prefill; chunks start off block boundaries"
    assert most_window_blocks <= kv.window.blocks.num_blocks < BLOCKS
    for r, prompt in zip(reqs, prompts):
        torch.testing.assert_close(torch.tensor(scored[r.id][1:]), prompt_logprobs(reference, prompt))
        assert r.generated == greedy(reference, prompt, r.max_new_tokens)
    assert len(set(reqs[0].generated + reqs[1].generated)) > 5  # a random model repeating a token proves little


def test_window_table_too_short_or_slid_too_far_is_refused(runner):
    prompt = list(range(3, 3 + 2 * WINDOW))
    first = Entry(7, prompt, list(range(8)), params=Params(), prompt_tokens=len(prompt),
                  new_window_blocks=list(range(7)))
    with pytest.raises(StepError, match="window table ends at token 28"):
        runner.step([first])
    first.new_window_blocks.append(7)
    runner.step([first])
    # The query at 32 still sees token 17 (block 4): dropping five blocks is one too many.
    decode = Entry(7, [5], [8], cached_tokens=len(prompt), new_window_blocks=[8], window_dropped=5)
    with pytest.raises(StepError, match="window table starts at token 20"):
        runner.step([decode])
