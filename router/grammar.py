"""Constrained decoding: a request's output held to a JSON schema, a regex or a Lark grammar, with llguidance.

The router holds the tokenizer, so it holds each constrained request's matcher (`Constraint`): before a step it
packs the request's allowed next tokens into a bitmask that travels with the step (proto `allowed_tokens`; every
rank gets the same, only rank 0 samples), the shard masks the logits before sampling, and the engine feeds the
sampled token back to the matcher. When the grammar is complete and only EOS may follow, the request ends at
once (finish reason `eos_token`), so it never waits a step for the EOS it must produce, even with `ignore_eos`.

Why llguidance over xgrammar (docs/api.md has the numbers): a schema compiles in ~2 ms against ~4 ms, a mask
over SmolLM2's 49k vocabulary costs ~12 us a request, it needs no other package, and every resource it uses on
user input is bounded by `LIMITS` (fuel for building and for each step, lexer states, grammar size), so a hostile
schema or regex fails with a 422 instead of stalling the router.

JSON is generated in one style, `{"a": 1, "b": [2, 3]}` (json.dumps' separators, no other whitespace): free
whitespace lets a small model pad with newlines until max_tokens.
"""
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import llguidance

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused before compiling
CACHED_GRAMMARS = 128  # compiled grammars kept (a request copies one in microseconds)
JSON_STYLE = {"key_separator": ": ", "item_separator": ", ", "whitespace_flexible": False}
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=200_000, verbose_errors=False)  # ~20 ms to build, ~15 a step
KINDS = ("json", "regex", "lark")


class GrammarError(ValueError):
    """The grammar a request gave cannot be used: the message says why, for the client."""


@dataclass(frozen=True)
class Spec:
    """What a request asks its output to match: kind is json (a JSON schema, as text), regex or lark."""
    kind: str
    value: str

    @staticmethod
    def json_schema(schema: Any) -> "Spec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        return Spec("json", json.dumps(schema))  # key order kept: properties are generated in it

    def grammar(self) -> str:
        """llguidance's grammar for this spec (not yet checked)."""
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {self.kind} grammar is {len(self.value)} characters; at most "
                               f"{MAX_GRAMMAR_CHARS} are accepted")
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_STYLE)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        return llguidance.LLMatcher.grammar_from_lark(self.value)


class Constraint:
    """One request's matcher: the tokens it allows next, and the tokens it was given."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def allowed(self) -> bytes:
        """The next token's bitmask: bit t of little-endian 32-bit word t // 32 set when token t is allowed."""
        return self.matcher.compute_bitmask()

    def accept(self, token: int) -> bool:
        """Advances past a sampled token; False when the grammar did not allow it (the request must end)."""
        return self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Only EOS can follow: the output is a full match."""
        return self.matcher.is_stopped()


class Grammars:
    """The llguidance tokenizer (built on first use: ~0.3 s) and the compiled grammars, shared by every request;
    compile() is called from the validation threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self._tokenizer: Optional[llguidance.LLTokenizer] = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(tokenizer_json(self.hf_tokenizer), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids or self.hf_tokenizer.eos_token_id)
            return self._tokenizer

    def compile(self, spec: Spec) -> Constraint:
        """A fresh matcher for `spec`, or GrammarError naming what is wrong with it."""
        try:
            grammar = spec.grammar()
        except ValueError as e:  # GrammarError, or llguidance refusing a schema that is not an object
            raise GrammarError(str(e)) from None
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return Constraint(template.deep_copy())
        template = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=self.limits)
        if template.is_error():
            raise GrammarError(f"invalid {describe(spec.kind)}: {one_line(template.get_error())}")
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return Constraint(template.deep_copy())


def tokenizer_json(tokenizer) -> str:
    """The tokenizer as llguidance reads it. A GGUF's byte-level BPE converts with a decoder that starts with
    ByteFallback (SmolLM2's does), which llguidance takes for a sentencepiece vocabulary, reading "Ġ" as the
    bytes of "Ġ" rather than a space: such a tokenizer gets the plain ByteLevel decoder its pre-tokenizer implies."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") == "ByteLevel" for p in parts):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return json.dumps(spec)


def describe(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regex", "lark": "grammar"}[kind]


def one_line(error: str) -> str:
    """llguidance's error on one line, cut short (it may end with a picture of the grammar)."""
    return " ".join(error.split())[:400]
