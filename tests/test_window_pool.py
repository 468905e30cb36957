"""The sliding-window layers' own KV pool, driven directly on a shard's Runner (no gRPC, no router).

A tiny random hybrid Gemma 3 (sliding and full layers, window 16, blocks of 4 tokens) is served in chunks, two
requests at once, while a stand-in for the router drops every window block that slid out of the window and
hands freed blocks to the other request. Greedy tokens must equal transformers' `generate` far beyond the window,
and every prompt token's logprob (scored in chunks) its full forward pass.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from proto import generate_pb2 as pb
from shard import model as model_lib
from shard.runner import Runner, StepError

WINDOW, BS, CHUNK, BATCH = 16, 4, 10, 2
NUM_WINDOW_BLOCKS = BATCH * (-(-(WINDOW - 1) // BS) + 2) + -(-CHUNK * BATCH // BS)  # the Warmup formula


class WindowRouter:
    """Block bookkeeping as the router does it: full-pool tables grow; window tables drop from the front every
    block whose tokens are all older than the step's first query can see, and grow by what the step writes."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks))
        self.free_window = list(range(NUM_WINDOW_BLOCKS))[::-1]
        self.reqs: dict[int, dict] = {}
        self.most_window_blocks = 0

    def entry(self, rid: int, ids: list[int], sample: bool, prompt_tokens: int = 0) -> pb.StepEntry:
        first = rid not in self.reqs
        r = self.reqs.setdefault(rid, {"cached": 0, "blocks": [], "window": [], "base": 0})
        start, end = r["cached"], r["cached"] + len(ids)
        new = [self.free.pop() for _ in range(-(-end // BS) - len(r["blocks"]))]
        r["blocks"] += new
        dropped = max(0, (start - WINDOW + 1) // BS - r["base"])
        self.free_window += r["window"][:dropped]
        r["window"], r["base"] = r["window"][dropped:], r["base"] + dropped
        new_window = [self.free_window.pop() for _ in range(-(-end // BS) - r["base"] - len(r["window"]))]
        r["window"] += new_window
        self.most_window_blocks = max(self.most_window_blocks, NUM_WINDOW_BLOCKS - len(self.free_window))
        entry = pb.StepEntry(id=rid, input_ids=ids, new_blocks=new, sample=sample, cached_tokens=start,
                             new_window_blocks=new_window, window_dropped=dropped)
        if first:
            entry.parameters.CopyFrom(pb.SamplingParameters(prefill_logprobs=True))
            entry.prompt_tokens = prompt_tokens
        r["cached"] = end
        return entry


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
    runner.warmup(CHUNK * BATCH)
    runner.allocate(64, NUM_WINDOW_BLOCKS)
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
    assert cache.full.shape == (1, 2, 1, 64, BS, 32)
    assert cache.window.shape == (3, 2, 1, NUM_WINDOW_BLOCKS, BS, 32)
    assert [(p is cache.window, j) for p, j in cache.where] == [(True, 0), (True, 1), (False, 0), (True, 2)]


def test_greedy_beyond_the_window_equals_transformers(runner, reference):
    """Prompts of 3x and 2x the window, in chunks of 10 (never block-aligned), the second joining while the
    first still prefills; then decodes to 4x the window."""
    gen = torch.Generator().manual_seed(1)
    prompts = {1: torch.randint(3, 256, (3 * WINDOW,), generator=gen).tolist(),
               2: torch.randint(3, 256, (2 * WINDOW + 3,), generator=gen).tolist()}
    new_tokens = {1: 20, 2: 30}
    router = WindowRouter(64)
    fed = {rid: 0 for rid in prompts}
    out: dict[int, list[int]] = {rid: [] for rid in prompts}
    scored: dict[int, list[float]] = {rid: [] for rid in prompts}
    step = 0
    while any(len(out[rid]) < new_tokens[rid] for rid in prompts):
        entries = []
        for rid, prompt in prompts.items():
            if rid == 2 and step < 2 or len(out[rid]) >= new_tokens[rid]:
                continue
            if fed[rid] < len(prompt):
                ids = prompt[fed[rid]:fed[rid] + CHUNK]
                fed[rid] += len(ids)
                entries.append(router.entry(rid, ids, fed[rid] == len(prompt), len(prompt)))
            else:
                entries.append(router.entry(rid, out[rid][-1:], sample=True))
        generations, prefill, _ = runner.step(entries)
        for g in generations:
            out[g.id].append(g.token_id)
        for p in prefill:
            scored[p.id] += p.logprobs
        step += 1
    assert router.reqs[1]["base"] > 0 and router.reqs[2]["base"] > 0  # both tables slid
    assert router.most_window_blocks <= NUM_WINDOW_BLOCKS
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(scored[rid][1:]), prompt_logprobs(reference, prompt))
        assert out[rid] == greedy(reference, prompt, new_tokens[rid])
    assert len(set(out[1] + out[2])) > 5  # a random model repeating one token would prove little


def test_window_table_too_short_or_slid_too_far_is_refused(runner):
    prompt = list(range(3, 3 + 2 * WINDOW))
    first = pb.StepEntry(id=7, input_ids=prompt, new_blocks=range(8), new_window_blocks=range(7),
                         parameters=pb.SamplingParameters(), prompt_tokens=len(prompt))
    with pytest.raises(StepError, match="window table ends at token 28"):
        runner.step([first])
    first.new_window_blocks.append(7)
    runner.step([first])
    # The query at 32 still sees token 17 (block 4): dropping five blocks is one too many.
    decode = pb.StepEntry(id=7, input_ids=[5], new_blocks=[8], new_window_blocks=[8], window_dropped=5,
                          cached_tokens=len(prompt))
    with pytest.raises(StepError, match="window table starts at token 20"):
        runner.step([decode])
