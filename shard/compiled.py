"""Step sizes compiled once, at Warmup: the lean forward pass through torch.compile (inductor), one mechanism with
two backends. On CPU inductor fuses the small ops between the GEMMs (norms, rotary, residuals, SiLU: some
twenty-five a layer, each a few microseconds of dispatch when a step holds one request) and drops the Python
around them. On CUDA the graphs are also captured (mode "reduce-overhead": CUDA graphs), piece by piece around
the paged attention, which reads the step's block tables and so stays outside every graph (its op is tagged
cudagraph-unsafe and inductor partitions the graph around it, as vLLM's piecewise graphs do).

On CPU the sizes above 1 share one graph whose token count is symbolic (one compile rather than one per size):
any step of 2 to the largest size runs it (float32 at its own size; bf16 padded up to a compiled size, since
oneDNN builds a kernel per shape), and size 1 has its own (bf16 on oneDNN: kept only where Warmup timed it faster
than the eager step on this CPU, `race_single`). On CUDA each
size is captured alone and a step is padded up to the next one (the runner pads: runner.py). Any other step runs the same forward eagerly. The
symbolic graph computes logits for the rows asked for only, a CUDA graph for all of its rows (one shape per
size), handing back those asked for. When they compile is compiling.py's decision; served steps use the graphs only
once all are compiled (`ready`), and nothing compiles after that: were a step the graphs do not cover routed to
them (a guard fails), it runs eagerly rather than stall the server, and is counted as eager.
"""
import logging
import statistics
import threading
import time
from typing import Callable, Optional

import torch
import torch._inductor.config
import torch.fx.experimental._config
from torch import nn

from shard import attention

log = logging.getLogger("cb.shard")


# attention.attend as one op no graph looks into: it writes the layer's cache and reads the step's layout, both
# outside the graph's inputs. Defined on a Library rather than with torch.library.custom_op, whose Python wrapper
# costs tens of microseconds a call (thirty calls a step)
_library = torch.library.Library("cb", "FRAGMENT")
_library.define("paged_attention(int layer, Tensor query, Tensor key, Tensor value, float scale) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))
_library.impl("paged_attention", lambda layer, query, key, value, scale:
              attention.attend(layer, query, key, value, scale, None), "CompositeExplicitAutograd")
torch.library.register_fake("cb::paged_attention", lambda layer, query, key, value, scale:
                            query.new_empty(query.shape[1], query.shape[0] * query.shape[2]), lib=_library)
paged_attention = torch.ops.cb.paged_attention.default


class CompiledForward:
    """The model's forward (ids [T], positions [T], rows to keep [K] -> logits [K, vocab]), compiled for a few
    step sizes, eager for the rest."""

    def __init__(self, model: nn.Module, device: torch.device, sizes: tuple[int, ...], race: bool = False):
        self.model, self.sizes, self.race = model, sizes, race and 1 in sizes
        self.timings: dict[str, float] = {}  # the race's median step seconds, compiled and eager
        # in the thread compiling or racing (compiling.py), not in one serving meanwhile: `compiling` (a step may
        # compile), `trial` (steps run the graphs before they are ready), `bypass` (the race's eager turns)
        self._here = threading.local()
        self.cuda = device.type == "cuda"
        config = torch._dynamo.config  # on CUDA one graph per size, which dynamo would stop compiling at 8
        config.recompile_limit = max(config.recompile_limit, len(sizes) + 1)
        # bf16: round where eager rounds (inductor would keep fused intermediates in fp32), so a request's tokens
        # do not depend on whether its step ran a graph; ~1% of a step here
        torch._inductor.config.emulate_precision_casts = True
        if self.cuda:  # graphs in pieces around the attention op (newer torch does so by default)
            torch._inductor.config.graph_partition = True
        self.graphs = torch.compile(model, fullgraph=True, dynamic=False,
                                    mode="reduce-overhead" if self.cuda else None)
        self.ready = False  # every size compiled, and served steps run the graphs
        self.seconds = 0.0  # the compile's time

    def _flag(self, name: str) -> bool:
        return getattr(self._here, name, False)

    def pad_to(self, tokens: int) -> Optional[int]:
        """The compiled size a step of `tokens` rows is padded to; None beyond the largest."""
        if not self.cuda and self.sizes and tokens < self.sizes[0]:  # below every graph on CPU: eager, unpadded
            return None
        return next((s for s in self.sizes if s >= tokens), None)

    def compile(self, run_step: Callable[[int], None]) -> bool:
        """Compiles (and on CUDA captures) every size by running a step of that many tokens through `run_step`, in
        the calling thread; served steps go on eagerly until `ready` is set. A failure leaves the forward eager, and
        says why."""
        start = time.perf_counter()
        self._here.compiling = self._here.trial = True
        try:
            for size in self.sizes:
                for _ in range(3 if self.cuda else 1):  # CUDA graphs: a warm-up run, the capture, a replay
                    run_step(size)
            compiled = True
        except Exception as error:  # a model or backend inductor cannot compile: serve eagerly
            log.warning("compiling step sizes %s failed, every step runs eagerly: %s: %s", self.sizes,
                        type(error).__name__, str(error)[:2000])
            self.sizes, compiled = (), False
        finally:
            self._here.compiling = self._here.trial = False
        self.seconds = time.perf_counter() - start
        if compiled:
            log.info("compiled step sizes %s in %.1f s", ",".join(map(str, self.sizes)), self.seconds)
        return compiled

    def race_single(self, run_step: Callable[[int], None], rounds: int = 9) -> None:
        """bf16 on oneDNN, a step of one request: compiled it ran 0.89x the eager step's speed on a Zen 4 and
        1.13-1.17x on a Sapphire Rapids (in-process, 2026-12-06), so both run here, interleaved, and the faster stays."""
        seconds: dict[bool, list[float]] = {True: [], False: []}
        self._here.trial = True
        try:
            for _ in range(rounds):
                for eager in (False, True):
                    self._here.bypass = eager
                    start = time.perf_counter()
                    run_step(1)
                    seconds[eager].append(time.perf_counter() - start)
        finally:
            self._here.bypass = self._here.trial = False
        self.timings = {"compiled": statistics.median(seconds[False]), "eager": statistics.median(seconds[True])}
        if self.timings["eager"] < self.timings["compiled"]:
            self.sizes = tuple(s for s in self.sizes if s != 1)
        log.info("a step of one request: %.2f ms compiled, %.2f ms eager: runs %s", self.timings["compiled"] * 1e3,
                 self.timings["eager"] * 1e3, "compiled" if 1 in self.sizes else "eagerly")

    def covers(self, tokens: int) -> bool:
        """A graph exists for a step of exactly `tokens` rows."""
        if self._flag("bypass") or not (self.ready or self._flag("trial")):
            return False
        if self.cuda or tokens == 1:
            return tokens in self.sizes
        return 2 <= tokens <= self.sizes[-1]  # the symbolic graph

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The logits, and whether a compiled graph computed them."""
        if self.covers(ids.shape[0]):
            try:
                return self._compiled(ids, positions, keep), True
            except RuntimeError as error:  # a guard failed after Warmup: this step runs eagerly
                if not str(error).startswith("Detected recompile"):
                    raise
        return self.model(ids, positions, keep), False

    def _compiled(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        tokens, wanted = ids.shape[0], keep.shape[0]
        if self.cuda or tokens == 1:  # static shapes: every row's logits, then the ones asked for
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
            every_row = torch.arange(tokens, device=keep.device)
            logits = self._run(ids, positions, every_row)
            if self.cuda or not torch.equal(keep, every_row):
                return logits[keep]  # on CUDA a copy: the graph's output memory is the next replay's
            return logits
        # the symbolic graph: rows and kept rows are sizes of their own, so the LM head computes only the kept
        # rows (at least two: dynamo keeps sizes 0 and 1 apart, so fewer are padded with row 0 and dropped)
        rows = keep if wanted >= 2 else torch.cat([keep, keep.new_zeros(2 - wanted)])
        for t in (ids, positions, rows):
            torch._dynamo.mark_dynamic(t, 0, min=2, max=self.sizes[-1])
        logits = self._run(ids, positions, rows)
        return logits if wanted >= 2 else logits[:wanted]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self._flag("compiling"):  # rows and kept rows of equal sizes get separate symbols, not one (duck shaping)
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return self.graphs(ids, positions, rows)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.graphs(ids, positions, rows)


def for_model(model: nn.Module, device: torch.device, sizes: tuple[int, ...],
              world: int = 1) -> Optional[CompiledForward]:
    """The compiled forward of a lean model, or None (no sizes, or transformers' own modules, which stay eager).
    bf16 on oneDNN races its one-request step (`CompiledForward.race_single`) in a shard alone; tensor-parallel shards
    could each decide otherwise and round their replicated norms differently, so there it stays eager."""
    from shard.lean import LeanLlama
    from shard.linears import Packed

    packed = any(isinstance(m, Packed) for m in model.modules())
    if packed and world > 1:
        sizes = tuple(s for s in sizes if s > 1)
    if not sizes or not isinstance(model, LeanLlama):
        return None
    return CompiledForward(model, device, sizes, race=packed)
