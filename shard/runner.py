"""Executes one step: the ragged batch the router scheduled, in one forward pass, then sampling.

The runner keeps, per running request, what the router need not resend: sampling parameters, the block
tables and the number of cached tokens (and the token history, for penalties).
"""
import time
from dataclasses import dataclass, field

import torch

from proto import generate_pb2 as pb
from shard import attention
from shard.attention import Group, PoolStep, StepLayout
from shard.kv_cache import KVCache
from shard.model import LoadedModel
from shard.sampling import Params, sample


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
    pending_row: torch.Tensor | None = None  # last prompt row's logits, scoring the next chunk's first token

    def wants_prefill_logprobs(self, n: int) -> bool:
        return self.prefill_logprobs and self.cached < self.prompt_tokens and n > 0


class StepError(Exception):
    pass


class Runner:
    def __init__(self, loaded: LoadedModel, device: torch.device, block_size: int, rank: int, world: int):
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.block_size = block_size
        self.rank = rank
        self.world = world
        self.cache: KVCache | None = None
        self.requests: dict[int, RequestState] = {}

    def allocate(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        m = self.loaded
        self.cache = None  # the old pools are freed before the new ones are allocated
        self.cache = KVCache(m.sliding, num_blocks, num_window_blocks, self.block_size, m.kv_heads, m.head_dim,
                             self.model.dtype, self.device)

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
    def step(self, entries) -> tuple[list[pb.Generation], list[pb.PrefillLogprobs], int]:
        """entries: proto StepEntry list. Returns (generations, prompt logprobs, forward nanoseconds)."""
        states = [self._state(e) for e in entries]
        windowed = self.cache.window is not None
        ids, positions, slots, window_slots, keep = [], [], [], [], []
        decode, chunks = [], []
        offset = 0
        for e, st in zip(entries, states):
            n = len(e.input_ids)
            pos = torch.arange(st.cached, st.cached + n)
            ids.append(torch.tensor(e.input_ids))
            positions.append(pos)
            slots.append(self._slots(st.blocks, 0, pos))
            if windowed:
                window_slots.append(self._slots(st.window_blocks, st.window_base, pos))
            (decode if n == 1 else chunks).append((offset, n, st))
            if st.wants_prefill_logprobs(n):
                keep.extend(range(offset, offset + n))
            elif e.sample:
                keep.append(offset + n - 1)
            offset += n
        members = [g for g in (decode, chunks) if g]
        layout = StepLayout(
            full=self._pool_step(slots, members, window=False),
            window=self._pool_step(window_slots, members, window=True) if windowed else None,
            cache=self.cache.layers,
        )
        start = time.perf_counter_ns()
        attention.set_step(layout)
        try:
            out = self.model(
                input_ids=torch.cat(ids).unsqueeze(0).to(self.device),
                position_ids=torch.cat(positions).unsqueeze(0).to(self.device),
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                use_cache=False,
            )
        finally:
            attention.set_step(None)
        logits = out.logits[0]
        row_of = {k: i for i, k in enumerate(keep)}
        prefill, sampled, offset = [], [], 0
        for e, st in zip(entries, states):
            n = len(e.input_ids)
            if st.wants_prefill_logprobs(n) and self.rank == 0:
                prefill.append(pb.PrefillLogprobs(id=e.id, logprobs=self._prompt_logprobs(
                    st, e.input_ids, logits[row_of[offset]:row_of[offset + n - 1] + 1])))
            if e.sample:
                sampled.append((e, st, row_of[offset + n - 1]))
            st.cached += n
            if st.params.penalized:
                st.history.extend(e.input_ids)
            offset += n
        generations = []
        if self.rank == 0 and sampled:
            picks = sample(logits[[r for _, _, r in sampled]], [st.params for _, st, _ in sampled],
                           [self._history(st) for _, st, _ in sampled], [st.cached for _, st, _ in sampled])
            generations = [
                pb.Generation(id=e.id, token_id=tok, logprob=lp,
                              top_tokens=[pb.TopToken(token_id=t, logprob=v) for t, v in top])
                for (e, _, _), (tok, lp, top) in zip(sampled, picks)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return generations, prefill, time.perf_counter_ns() - start

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

    def _state(self, e) -> RequestState:
        first = e.HasField("parameters")
        if first:
            self.requests[e.id] = RequestState(Params.from_proto(e.parameters), e.prompt_tokens,
                                               e.parameters.prefill_logprobs, cached=e.cached_tokens)
        st = self.requests.get(e.id)
        if st is None:
            raise StepError(f"request {e.id} is not known to this shard")
        if st.cached != e.cached_tokens:
            raise StepError(f"request {e.id}: shard holds {st.cached} tokens, router says {e.cached_tokens}")
        st.blocks.extend(e.new_blocks)
        if -(-(st.cached + len(e.input_ids)) // self.block_size) > len(st.blocks):
            raise StepError(f"request {e.id}: {len(st.blocks)} blocks cannot hold its tokens")
        if self.cache.window is not None:
            self._slide(e, st, first)
        return st

    def _slide(self, e, st: RequestState, first: bool) -> None:
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

    def _slots(self, table: list[int], base: int, pos: torch.Tensor) -> torch.Tensor:
        """Cache slot of each position, in a block table whose first block is logical block `base`."""
        return torch.tensor(table)[pos // self.block_size - base] * self.block_size + pos % self.block_size

    def _history(self, st: RequestState):
        return torch.tensor(st.history, device=self.device) if st.params.penalized else None

    def _pool_step(self, slots: list[torch.Tensor], members, window: bool) -> PoolStep:
        return PoolStep(torch.cat(slots).to(self.device), [self._group(g, window) for g in members],
                        self.block_size, {})

    def _group(self, members, window: bool) -> Group:
        """window: address the sliding layers' pool (window tables, keys from window_base on)."""
        tables = [st.window_blocks if window else st.blocks for _, _, st in members]
        width = max(len(t) for t in tables)
        q = max(n for _, n, _ in members)
        rows = torch.zeros(len(members), q, dtype=torch.long)
        valid = torch.zeros(len(members), q, dtype=torch.bool)
        padded = torch.zeros(len(members), width, dtype=torch.long)
        qpos = torch.zeros(len(members), q, dtype=torch.long)
        kv_len = torch.zeros(len(members), dtype=torch.long)
        key_start = torch.zeros(len(members), dtype=torch.long)
        for i, ((offset, n, st), table) in enumerate(zip(members, tables)):
            rows[i, :n] = torch.arange(offset, offset + n)
            valid[i, :n] = True
            padded[i, :len(table)] = torch.tensor(table)
            qpos[i, :n] = torch.arange(st.cached, st.cached + n)
            kv_len[i] = st.cached + n
            key_start[i] = st.window_base * self.block_size if window else 0
        d = self.device
        return Group(rows.to(d), valid.to(d), padded.to(d), qpos, kv_len, key_start)

    def warmup(self, max_prefill_tokens: int) -> None:
        """One forward at the largest step size, so activation memory is known before the pool is sized."""
        blocks = -(-max_prefill_tokens // self.block_size)
        windowed = any(self.loaded.sliding)
        self.allocate(blocks, blocks if windowed else 0)
        self.requests.clear()
        entry = pb.StepEntry(id=0, input_ids=[1] * max_prefill_tokens, new_blocks=list(range(blocks)),
                             new_window_blocks=list(range(blocks)) if windowed else [],
                             sample=True, parameters=pb.SamplingParameters())
        self.step([entry])
        self.requests.clear()
        self.cache = None
