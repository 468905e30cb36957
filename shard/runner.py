"""Executes one step: the ragged batch the router scheduled, in one forward pass, then sampling.

The runner keeps, per running request, what the router need not resend: sampling parameters, the block
table and the number of cached tokens (and the token history, for penalties).
"""
import time
from dataclasses import dataclass, field

import torch

from proto import generate_pb2 as pb
from shard import attention
from shard.attention import Group, StepLayout
from shard.kv_cache import KVCache
from shard.model import LoadedModel
from shard.sampling import Params, sample


@dataclass
class RequestState:
    params: Params
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    history: list[int] = field(default_factory=list)


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

    def allocate(self, num_blocks: int, swap_blocks: int = 0) -> None:
        m = self.loaded
        self.cache = None
        self.cache = KVCache(m.num_layers, num_blocks, self.block_size, m.kv_heads, m.head_dim,
                             self.model.dtype, self.device, swap_blocks)

    def filter(self, remove_ids) -> None:
        for i in remove_ids:
            self.requests.pop(i, None)

    def clear(self) -> None:
        self.requests.clear()

    @torch.inference_mode()
    def step(self, entries) -> tuple[list[tuple[int, int, float]], int]:
        """entries: proto StepEntry list. Returns ([(id, token, logprob)], forward nanoseconds)."""
        states = [self._state(e) for e in entries]
        ids, positions, slots, sample_rows = [], [], [], []
        decode, chunks = [], []
        offset = 0
        for e, st in zip(entries, states):
            n = len(e.input_ids)
            pos = torch.arange(st.cached, st.cached + n)
            table = torch.tensor(st.blocks)
            ids.append(torch.tensor(e.input_ids))
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            (decode if n == 1 else chunks).append((offset, n, st))
            offset += n
            if e.sample:
                sample_rows.append(offset - 1)
        layout = StepLayout(
            slots=torch.cat(slots).to(self.device),
            groups=[self._group(g) for g in (decode, chunks) if g],
            block_size=self.block_size, cache=self.cache.layers, _masks={},
        )
        start = time.perf_counter_ns()
        attention.set_step(layout)
        try:
            out = self.model(
                input_ids=torch.cat(ids).unsqueeze(0).to(self.device),
                position_ids=torch.cat(positions).unsqueeze(0).to(self.device),
                logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
                use_cache=False,
            )
        finally:
            attention.set_step(None)
        for e, st in zip(entries, states):
            st.cached += len(e.input_ids)
            if st.params.penalized:
                st.history.extend(e.input_ids)
        sampled = [(e, st) for e, st in zip(entries, states) if e.sample]
        results = []
        if self.rank == 0 and sampled:
            picks = sample(out.logits[0], [st.params for _, st in sampled],
                           [self._history(st) for _, st in sampled], [st.cached for _, st in sampled])
            results = [(e.id, tok, lp) for (e, _), (tok, lp) in zip(sampled, picks)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return results, time.perf_counter_ns() - start

    def _state(self, e) -> RequestState:
        if e.HasField("parameters"):
            self.requests[e.id] = RequestState(Params.from_proto(e.parameters))
        st = self.requests.get(e.id)
        if st is None:
            raise StepError(f"request {e.id} is not known to this shard")
        if st.cached != e.cached_tokens:
            raise StepError(f"request {e.id}: shard holds {st.cached} tokens, router says {e.cached_tokens}")
        st.blocks.extend(e.new_blocks)
        if -(-(st.cached + len(e.input_ids)) // self.block_size) > len(st.blocks):
            raise StepError(f"request {e.id}: {len(st.blocks)} blocks cannot hold its tokens")
        return st

    def _history(self, st: RequestState):
        return torch.tensor(st.history, device=self.device) if st.params.penalized else None

    def _group(self, members) -> Group:
        width = max(len(st.blocks) for _, _, st in members)
        q = max(n for _, n, _ in members)
        rows = torch.zeros(len(members), q, dtype=torch.long)
        valid = torch.zeros(len(members), q, dtype=torch.bool)
        tables = torch.zeros(len(members), width, dtype=torch.long)
        qpos = torch.zeros(len(members), q, dtype=torch.long)
        kv_len = torch.zeros(len(members), dtype=torch.long)
        for i, (offset, n, st) in enumerate(members):
            rows[i, :n] = torch.arange(offset, offset + n)
            valid[i, :n] = True
            tables[i, :len(st.blocks)] = torch.tensor(st.blocks)
            qpos[i, :n] = torch.arange(st.cached, st.cached + n)
            kv_len[i] = st.cached + n
        d = self.device
        return Group(rows.to(d), valid.to(d), tables.to(d), qpos, kv_len)

    def warmup(self, max_prefill_tokens: int) -> None:
        """One forward at the largest step size, so activation memory is known before the pool is sized."""
        blocks = -(-max_prefill_tokens // self.block_size)
        self.allocate(blocks)
        self.requests.clear()
        entry = pb.StepEntry(id=0, input_ids=[1] * max_prefill_tokens, new_blocks=list(range(blocks)),
                             sample=True, parameters=pb.SamplingParameters())
        self.step([entry])
        self.requests.clear()
        self.cache = None
