"""Every setting of a cb server, declared once: its flag, environment variable, default and meaning.

`cb-launcher` builds its command line from this declaration (TGI's spelling: `--max-batch-size` and
`MAX_BATCH_SIZE`), hands the router the values it settled on as JSON in CB_SETTINGS (so no secret shows in
`ps`), and passes the shards the few they need. `cb-sim` takes the scheduling ones from here too.
Pure Python; typer is imported only to build a command line.
"""
import dataclasses
import enum
import functools
import inspect
import json
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Optional

from router.core.scheduler import POLICIES

ENV = "CB_SETTINGS"


def setting(default, help: str, *, choices: tuple = (), min: Optional[float] = None,
            max: Optional[float] = None):
    return field(default=default, metadata={"help": help, "choices": choices, "min": min, "max": max})


@dataclass(frozen=True)
class Settings:
    model_id: str = setting("smollm2", "smollm2, gemma3-270m, a .gguf file, or a directory with config.json "
                            "(never downloaded)")
    served_model_name: Optional[str] = setting(None, "the model's name in responses and /v1/models "
                                               "(default: --model-id)")
    num_shard: int = setting(1, "tensor-parallel shard processes (with --nnodes, on all the nodes together)", min=1)
    nnodes: int = setting(1, "machines one tensor-parallel set spans, --num-shard / --nnodes shards on each "
                          "(torchrun's --nnodes); node 0 also runs the router and serves HTTP", min=1)
    node_rank: int = setting(0, "this machine's place among --nnodes (torchrun's --node-rank)", min=0)
    master_addr: str = setting("127.0.0.1", "node 0's address on the network the nodes share (torchrun's "
                               "--master-addr): every node's shards meet at its store, and their collectives and "
                               "gRPC use the interface that reaches it. That network must be trusted")
    master_port: int = setting(29500, "node 0's port for that store (torchrun's --master-port; --nnodes > 1 only)",
                               min=1, max=65535)
    port: int = setting(8080, "HTTP port")
    hostname: str = setting("127.0.0.1", "HTTP bind address")
    max_concurrent_requests: int = setting(128, "requests in flight at once; beyond it: 429", min=1)
    max_input_tokens: int = setting(1024, "longest prompt, in tokens", min=1)
    max_total_tokens: int = setting(2048, "prompt + max_new_tokens per request (also the default budget of "
                                    "max_new_tokens)", min=2)
    max_batch_prefill_tokens: int = setting(512, "prompt tokens computed per step (longer prompts are chunked)",
                                            min=1)
    max_batch_total_tokens: Optional[int] = setting(None, "tokens the running batch may hold in the KV cache; "
                                                    "sizes the pool (default: from free memory)", min=1)
    max_batch_size: int = setting(64, "running requests at once", min=1)
    waiting_served_ratio: float = setting(0.0, "with requests running, admit only once this many waiting "
                                          "requests per running one are queued (or --max-waiting-tokens passed); "
                                          "TGI's 0.3 batches prompts at the cost of their TTFT", min=0.0)
    max_waiting_tokens: int = setting(20, "steps after which waiting requests are admitted whatever the ratio",
                                      min=0)
    prefill_step_ratio: float = setting(1.7, "while requests decode, a step that also computes prompt tokens may "
                                        "take at most this many times their step alone (a cost model fitted to the "
                                        "steps run sizes its prompt chunk, at least 16 tokens); 0 turns it off, "
                                        "else above 1", min=0.0)
    scheduler: str = setting("fifo", "order of work within a step: fifo (decodes first) or prefill_first "
                             "(chunked prompts first)", choices=tuple(POLICIES))
    safety_margin: Optional[float] = setting(None, "hold new prompts while free KV blocks are below this fraction "
                                             "of the pool; 0 disables (default: fifo 0.15, prefill_first 0)",
                                             min=0.0, max=1.0)
    prefix_caching: bool = setting(True, "share the KV blocks of common prompt prefixes (off by itself for "
                                   "sliding-window models)")
    speculate: int = setting(0, "prompt-lookup speculation: propose up to this many tokens a step from a request's "
                             "own context, verified in the same step (0: off; not for sliding-window models)",
                             min=0, max=16)
    cpu_offload_space: float = setting(4.0, "GiB of host memory per shard for offloaded requests' KV blocks "
                                       "(0: evictions are soft resets)", min=0.0)
    num_blocks: Optional[int] = setting(None, "KV blocks in the pool, instead of sizing it from "
                                        "--max-batch-total-tokens or free memory", min=1)
    block_size: int = setting(16, "tokens per KV block", min=1)
    max_memory_percent: float = setting(0.9, "share of free memory (CPU: available RAM) the KV pool may take "
                                        "when no size is given", min=0.01, max=1.0)
    dtype: str = setting("auto", "weights and KV cache; auto: bfloat16 where the device computes in it (a GPU "
                         "with bf16, a CPU with AVX512-BF16 or AMX), else float32 (float16 on a GPU); float32 is "
                         "the exact mode the golden tests use", choices=("auto", "bfloat16", "float16", "float32"))
    device: str = setting("auto", "where the shards run (auto: cuda when available)", choices=("auto", "cpu", "cuda"))
    quantize: Optional[str] = setting(None, "weight-only quantized linear layers, activations in --dtype (an fp32 "
                                      "model's enter the quantized GEMMs in bf16): int8 (per output channel) or "
                                      "int4 (groups of 32, CPU only); faster for a few requests at a time, slower "
                                      "for large batches", choices=("int8", "int4"))
    compile_sizes: str = setting("auto", "step sizes, in tokens, compiled with torch.compile: a comma-separated "
                                 "list, auto (CPU 1,2,4,8,16,24,32; GPU 1,2,4,8,16,32) or 0 for none. One CPU shard "
                                 "compiles in the background while it serves eagerly; a GPU (which also captures them "
                                 "as CUDA graphs, TGI's --cuda-graphs) or --num-shard > 1 compiles before serving. A "
                                 "step up to the largest is padded to the next size; longer ones run eagerly (in bf16 "
                                 "on oneDNN, steps of 1 token too where Warmup times them faster so). Llama-family "
                                 "models only")
    uds_dir: Optional[str] = setting(None, "folder for the shards' sockets and the file their torch.distributed "
                                     "ranks meet through (default: a fresh temporary folder)")
    shard_timeout: float = setting(60.0, "most seconds a step may take (the deadline in force is 10x the slowest "
                                   "step served, at least 10 s, at most this); a step past it is a shard failure. "
                                   "A shard that stops answering Health while a step runs is failed sooner (~6 s)",
                                   min=1.0)
    max_restarts: int = setting(3, "times in a row a failed shard set is replaced (every request resumes) before "
                                "the server gives up and exits 1; an hour of service resets the count", min=0)
    graceful_timeout: float = setting(30.0, "seconds in-flight requests get to finish on shutdown", min=0.0)
    api_key: Optional[str] = setting(None, "require `Authorization: Bearer KEY` on every route but /health, "
                                     "/metrics and /info")
    api_key_file: Optional[str] = setting(None, "read --api-key from this file instead (its content, less "
                                          "surrounding whitespace; the router reads it at start-up)")
    payload_limit: int = setting(2_000_000, "largest request body, in bytes (413 beyond)", min=1)
    request_head_timeout: float = setting(10.0, "seconds a connection may take to send a request's head (also "
                                          "counted from the previous response on a kept-alive one); then it is "
                                          "closed", min=0.1)
    request_body_timeout: float = setting(30.0, "seconds a request's body may take to arrive after its head; "
                                          "then 408", min=0.1)
    max_stop_sequences: int = setting(4, "stop sequences per request", min=0)
    max_top_n_tokens: int = setting(5, "alternatives per token (top_n_tokens, logprobs)", min=0)
    trace_file: Optional[str] = setting(None, "write every scheduling decision here (JSON lines, replayed by "
                                        "cb-sim)")

    @property
    def margin(self) -> float:
        """The safety margin in force: the flag's, else the policy's default."""
        return POLICIES[self.scheduler] if self.safety_margin is None else self.safety_margin

    @property
    def model_name(self) -> str:
        """What responses and /v1/models call the model: what the user asked for, never a cache path."""
        return self.served_model_name or self.model_id

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> "Settings":
        """What the launcher handed its router (every default when run alone)."""
        return cls(**json.loads(os.environ.get(ENV) or "{}"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option(f: dataclasses.Field, optional: bool):
    """A typer option for one setting; `optional`: its default is None (the caller fills it in)."""
    import typer

    meta, default = f.metadata, None if optional else f.default
    flags = [f"{_flag(f.name)}/--no-{f.name.replace('_', '-')}"] if f.type is bool else [_flag(f.name)]
    shown = "" if f.default is None else f" [server default: {f.default}]" if optional else ""
    return typer.Option(default, *flags, envvar=None if optional else f.name.upper(),
                        help=meta["help"] + shown, min=meta["min"], max=meta["max"],
                        show_default=not optional and f.default is not None)


def _annotation(f: dataclasses.Field, optional: bool):
    hint = typing.get_type_hints(Settings)[f.name]
    if f.metadata["choices"]:
        hint = enum.Enum(f.name.title().replace("_", ""), {c: c for c in f.metadata["choices"]}, type=str)
    return Optional[hint] if optional or f.default is None else hint


def settings_command(names: Optional[tuple] = None, optional: bool = False):
    """Decorates a typer command with these settings (all by default) as options. The command receives
    `settings`: a Settings, or with `optional` a dict where None means "not given" (for tools such as cb-sim
    that fall back on a server's /info before the defaults)."""
    chosen = [f for f in fields(Settings) if names is None or f.name in names]

    def decorate(func):
        hints = typing.get_type_hints(func)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(func).parameters.values() if p.name != "settings"]
        extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_option(f, optional),
                                   annotation=_annotation(f, optional)) for f in chosen]

        @functools.wraps(func)
        def wrapper(**kwargs):
            values = {f.name: _plain(kwargs.pop(f.name)) for f in chosen}
            return func(settings=values if optional else Settings(**values), **kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
        del wrapper.__wrapped__
        return wrapper

    return decorate


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def flags_markdown() -> str:
    """Every setting as a markdown table (flag, environment variable, default, allowed values, meaning), for the
    README. Flag and variable are read off the same typer options the launcher builds, so the table cannot name a
    spelling the command line does not take. Regenerate with `python -m router.settings` (prints it) or
    `python -m router.settings --write README.md` (replaces the table between its markers)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    def value(v) -> str:
        return "on" if v is True else "off" if v is False else f"`{v}`"

    rows = ["| flag | env | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in fields(Settings):
        option, meta = _option(f, optional=False), f.metadata
        flag = " / ".join(f"`{spelling}`" for decl in option.param_decls for spelling in decl.split("/"))
        allowed = (" ".join(f"`{c}`" for c in meta["choices"]) if meta["choices"]
                   else f"{meta['min']} to {meta['max']}" if meta["min"] is not None and meta["max"] is not None
                   else f"≥ {meta['min']}" if meta["min"] is not None
                   else f"≤ {meta['max']}" if meta["max"] is not None else "")
        default = "none" if f.default is None else value(f.default)
        rows.append(f"| {flag} | `{option.envvar}` | {default} | {allowed} | {cell(meta['help'])} |")
    return "\n".join(rows) + "\n"


FLAGS_START, FLAGS_END = "<!-- flags:start -->", "<!-- flags:end -->"


def _write_flags(path: str) -> None:
    """Replaces what lies between the flags markers in `path` with flags_markdown()."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    head, _, rest = text.partition(FLAGS_START + "\n")
    _, end, tail = rest.partition(FLAGS_END)
    if not end:
        raise SystemExit(f"{path}: no {FLAGS_START} ... {FLAGS_END} markers")
    with open(path, "w", encoding="utf-8") as file:
        file.write(head + FLAGS_START + "\n" + flags_markdown() + FLAGS_END + tail)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        _write_flags(sys.argv[2])
    elif len(sys.argv) == 1:
        print(flags_markdown(), end="")
    else:
        raise SystemExit("usage: python -m router.settings [--write README.md]")
