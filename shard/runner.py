"""Executes one step: the ragged batch the router scheduled, in one forward pass, then sampling.

The runner keeps, per running request, what the router need not resend: sampling parameters, the block
tables and the number of cached tokens (and the token history, for penalties).
"""
import copy
import gc
import time
from dataclasses import dataclass, field

import torch

from shard import attention, compiled, layout, paged_kernel
from shard.kv_cache import KVCache, ceil_div
from shard.model import LoadedModel
from shard.profiling import scope
from shard.sampling import Params, constrain, sample, verify
from shard.step import Entry, Sampled, StepResult


@dataclass
class RequestState:
    params: Params
    prompt_tokens: int = 0
    prefill_logprobs: bool = False
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    # Hybrid models: the sliding layers' block table, holding only blocks a query can still see. Its first block
    # holds the tokens from window_base * block_size on (window_base: blocks dropped from its front so far).
    window_blocks: list[int] = field(default_factory=list)
    window_base: int = 0
    history: list[int] = field(default_factory=list)
    drafted: int = 0  # drafts its last step verified: how far the router may take its cache back
    pending_row: torch.Tensor | None = None  # last prompt row's logits, scoring the next chunk's first token

    def wants_prefill_logprobs(self, n: int) -> bool:
        return self.prefill_logprobs and self.cached < self.prompt_tokens and n > 0


class StepError(Exception):
    pass


class Runner:
    def __init__(self, loaded: LoadedModel, device: torch.device, block_size: int, rank: int, world: int,
                 compile_sizes: tuple[int, ...] = ()):
        self.loaded = loaded
        self.device = device
        self.block_size = block_size
        self.rank = rank
        self.world = world
        self.cache: KVCache | None = None
        self.requests: dict[int, RequestState] = {}
        self.kernel = paged_kernel.available(device)  # attention reads the cache in place: one decode group, no padding
        self.compiled = compiled.for_model(loaded.model, device, compile_sizes, world)  # None: every step eager
        # Steps run at their own size where no kernel is built per shape: float32 on CPU is MKL's GEMMs and
        # inductor's symbolic graph. bf16 (oneDNN primitives, one per shape) and quantized kernels are padded to
        # bounded sizes (layout.bucket), as are CUDA graphs (one per compiled size).
        self.exact_rows = device.type == "cpu" and loaded.dtype == torch.float32 and loaded.quantize is None

    def allocate(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        m = self.loaded
        self.cache = None  # the old pools are freed before the new ones are allocated
        self.cache = KVCache(m.sliding, num_blocks, num_window_blocks, self.block_size, m.kv_heads, m.head_dim,
                             m.dtype, self.device)

    def rebind(self, request_id: int, blocks: list[int]) -> None:
        """Replaces a request's full-pool block table after an offload (no blocks) or a restore (its new
        blocks); everything else about it is kept."""
        st = self.requests.get(request_id)
        if st is None:
            raise StepError(f"request {request_id} is not known to this shard")
        st.blocks = list(blocks)

    def filter(self, remove_ids) -> None:
        for i in remove_ids:
            self.requests.pop(i, None)

    def clear(self) -> None:
        self.requests.clear()

    @torch.inference_mode()
    def step(self, entries: list[Entry]) -> StepResult:
        """One forward over every entry's tokens, then sampling (rank 0 only)."""
        with scope("layout"):
            states = [self._state(e) for e in entries]
            # prompt chunks first, then decodes by width, so that each decode group's rows are consecutive
            order = sorted(range(len(entries)), key=lambda i: (len(entries[i].input_ids) == 1, len(states[i].blocks)))
            entries, states = [entries[i] for i in order], [states[i] for i in order]
            ids, positions, keep, layout = self._batch(entries, states)
        start = time.perf_counter_ns()
        attention.set_step(layout)
        try:
            with scope("forward"):
                rows = torch.tensor(keep, dtype=torch.long, device=self.device)
                if self.compiled is not None:
                    logits, ran_compiled = self.compiled(ids, positions, rows)
                else:
                    logits, ran_compiled = self.loaded.forward(ids, positions, rows), False
        finally:
            attention.set_step(None)
        with scope("sample"):
            prefill, sampled = self._collect(entries, states, logits, keep)
            generations = self._sample(logits, sampled) if self.rank == 0 and sampled else []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(generations, prefill, time.perf_counter_ns() - start, ran_compiled)

    def _collect(self, entries: list[Entry], states: list[RequestState], logits: torch.Tensor, keep: list[int]):
        """Prompt logprobs of the chunks that want them, the rows to sample from; every request moves on."""
        row_of = {k: i for i, k in enumerate(keep)}
        prefill, sampled, offset = [], [], 0
        for e, st in zip(entries, states):
            n = len(e.input_ids)
            if st.wants_prefill_logprobs(n) and self.rank == 0:
                rows = logits[row_of[offset]:row_of[offset + n - 1] + 1]
                prefill.append((e.id, self._prompt_logprobs(st, e.input_ids, rows)))
            if e.sample:
                sampled.append((e, st, [row_of[offset + i] for i in range(n - 1 - e.drafts, n)]))
            st.cached += n
            if st.params.penalized:
                st.history.extend(e.input_ids)
            offset += n
        return prefill, sampled

    def _batch(self, entries: list[Entry], states: list[RequestState]):
        """The ragged batch, padded to its bucket: token ids and positions [T], the rows whose logits are kept,
        the layout. Built as Python lists, each made a tensor once (layout.build says why)."""
        windowed = self.cache.window is not None
        bs = self.block_size
        ids, positions, slots, window_slots, keep = [], [], [], [], []
        decode, chunks = [], []
        offset = 0
        for e, st in zip(entries, states):
            n = len(e.input_ids)
            ids.extend(e.input_ids)
            positions.extend(range(st.cached, st.cached + n))
            slots.extend(layout.slots(st.blocks, 0, st.cached, n, bs))
            if windowed:
                window_slots.extend(layout.slots(st.window_blocks, st.window_base, st.cached, n, bs))
            (decode if n == 1 else chunks).append((offset, n, st))
            if st.wants_prefill_logprobs(n):
                keep.extend(range(offset, offset + n))
            elif e.sample:
                keep.extend(range(offset + n - 1 - e.drafts, offset + n))
            offset += n
        pad = self._padded(offset) - offset
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        slots.extend([self.cache.scratch_slot[0]] * pad)
        if windowed:
            window_slots.extend([self.cache.scratch_slot[1]] * pad)
        decodes = ([decode] if self.kernel else layout.split_decodes(decode)) if decode else []
        groups = ([chunks] if chunks else []) + decodes
        step_layout = layout.build(groups, slots, window_slots if windowed else None,
                                   self.cache, self.block_size, self.device, offset, self.kernel)
        long = torch.long
        return (torch.tensor(ids, dtype=long, device=self.device),
                torch.tensor(positions, dtype=long, device=self.device), keep, step_layout)

    def _padded(self, tokens: int) -> int:
        """The rows a step of `tokens` runs as: all its own where shapes cost nothing, else the next compiled
        size, else its bucket (layout.py)."""
        if self.exact_rows:
            return tokens
        return (self.compiled and self.compiled.pad_to(tokens)) or layout.bucket(tokens)

    def _sample(self, logits: torch.Tensor, sampled) -> list[Sampled]:
        """Each entry's next token; an entry with drafts verifies them on its rows (sampling.verify)."""
        plain = [(e, st, rows[-1]) for e, st, rows in sampled if not e.drafts]
        out = []
        if plain:
            rows = constrain(logits[[r for _, _, r in plain]], [e.allowed_tokens for e, _, _ in plain])
            picks = sample(rows, [st.params for _, st, _ in plain],
                           [self._history(st) for _, st, _ in plain], [st.cached for _, st, _ in plain])
            out = [Sampled(e.id, token, logprob, top) for (e, _, _), (token, logprob, top) in zip(plain, picks)]
        for e, st, rows in sampled:
            if e.drafts:
                made = verify(logits[rows], e.input_ids[-e.drafts:], st.params, st.cached - e.drafts)
                out.append(Sampled(e.id, made[0][0], made[0][1], more=made[1:]))
        return out

    def _roll_back(self, st: RequestState, n: int) -> None:
        """Forgets the last n cached tokens (rejected drafts): their KV is overwritten when the slots are reused."""
        st.cached -= n
        if st.params.penalized:
            del st.history[len(st.history) - n:]

    def _prompt_logprobs(self, st: RequestState, input_ids, rows: torch.Tensor) -> list[float]:
        """Row j scores token j+1; the previous chunk's last row scores this chunk's first token."""
        rows = rows.float()
        targets = torch.tensor(list(input_ids), device=rows.device)
        scored = []
        if st.pending_row is not None:
            scored.append(float(st.pending_row.log_softmax(-1)[targets[0]]))
        elif st.cached == 0:
            scored.append(float("nan"))
        inner = rows[:-1].log_softmax(-1).gather(1, targets[1:, None])[:, 0]
        scored.extend(inner.tolist())
        more_prompt = st.cached + len(targets) < st.prompt_tokens
        st.pending_row = rows[-1].clone() if more_prompt else None
        return scored

    def _state(self, e: Entry) -> RequestState:
        first = e.params is not None
        if first:
            self.requests[e.id] = RequestState(e.params, e.prompt_tokens, e.prefill_logprobs, cached=e.cached_tokens)
        st = self.requests.get(e.id)
        if st is None:
            raise StepError(f"request {e.id} is not known to this shard")
        if not first and st.cached > e.cached_tokens and st.cached - e.cached_tokens <= st.drafted:
            self._roll_back(st, st.cached - e.cached_tokens)  # rejected drafts (speculation)
        st.drafted = e.drafts
        if st.cached != e.cached_tokens:
            raise StepError(f"request {e.id}: shard holds {st.cached} tokens, router says {e.cached_tokens}")
        st.blocks.extend(e.new_blocks)
        if ceil_div(st.cached + len(e.input_ids), self.block_size) > len(st.blocks):
            raise StepError(f"request {e.id}: {len(st.blocks)} blocks cannot hold its tokens")
        if self.cache.window is not None:
            self._slide(e, st, first)
        return st

    def _slide(self, e: Entry, st: RequestState, first: bool) -> None:
        """Applies the router's changes to the window table, then checks that it still holds every key the
        step's queries see in the sliding layers and has a slot for every token the step writes."""
        if not first and e.window_dropped > len(st.window_blocks):
            raise StepError(f"request {e.id}: drops {e.window_dropped} window blocks, holds {len(st.window_blocks)}")
        del st.window_blocks[:e.window_dropped]
        st.window_base += e.window_dropped
        st.window_blocks.extend(e.new_window_blocks)
        bs, start, end = self.block_size, st.window_base * self.block_size, st.cached + len(e.input_ids)
        seen = max(0, st.cached - self.loaded.sliding_window + 1)  # the first query's oldest visible key
        if start > seen:
            raise StepError(f"request {e.id}: window table starts at token {start}, but token {seen} is still "
                            f"visible to the query at {st.cached}")
        if start + len(st.window_blocks) * bs < end:
            raise StepError(f"request {e.id}: window table ends at token {start + len(st.window_blocks) * bs}, "
                            f"the step writes up to token {end}")

    def _history(self, st: RequestState):
        return torch.tensor(st.history, device=self.device) if st.params.penalized else None

    def warmup(self, max_prefill_tokens: int) -> None:
        """One eager forward at the largest step size, so activation memory is known before the pool is sized."""
        blocks = ceil_div(max_prefill_tokens, self.block_size)
        windowed = any(self.loaded.sliding)
        self.allocate(blocks, blocks if windowed else 0)
        self.requests.clear()
        self.step([Entry(0, [1] * max_prefill_tokens, list(range(blocks)), sample=True, params=Params(),
                         new_window_blocks=list(range(blocks)) if windowed else [])])
        self.requests.clear()
        self.cache = None

    def scratch(self, num_blocks: int) -> "Runner":
        """A runner on the same weights and compiled forward, with a pool and requests of its own: it compiles in
        one thread while this one serves in another (each thread has its own step layout, attention.py)."""
        other = copy.copy(self)
        other.requests = {}
        other.allocate(num_blocks, num_blocks if any(self.loaded.sliding) else 0)
        return other

    def compile(self) -> bool:
        """Compiles every step size in the calling thread, on a scratch pool; served steps stay eager until
        `go_live`."""
        return self.compiled.compile(self.scratch(max(self.compiled.sizes))._one_token_requests)

    def go_live(self) -> None:
        """Served steps run the compiled graphs from now on; first, where asked, a step of one request races
        compiled against eager (CompiledForward.race_single) on a pool of its own: on the pool the compile used,
        both timed alike, on any pool allocated after it (as served) compiled ran 1.15x faster (cause not found)."""
        if self.compiled.race:
            self.compiled.race_single(self.scratch(1)._one_token_requests)
        self.compiled.ready = True
        gc.freeze()  # what compiling made lives as long as the process: out of the collector's way (server.Warmup)

    def _one_token_requests(self, n: int) -> None:
        """A step of n requests with a one-token prompt each (n rows), in n fresh blocks."""
        windowed = self.cache.window is not None
        self.step([Entry(i, [1], [i], sample=True, params=Params(), new_window_blocks=[i] if windowed else [])
                   for i in range(n)])
        self.requests.clear()
