"""TGI's request shape and its validation rules: a bad request is refused before it reaches the queue.

Every number that reaches the shards is checked or clamped here: floats are finite (pydantic refuses NaN and
infinities, raw or as strings), integers fit their proto fields, and what float32 cannot carry is clamped to a
value with the same meaning. Text is `Text`: valid Unicode, as the tokenizer needs.
"""
import random
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from proto import generate_pb2 as pb
from router.grammar import GrammarError, Spec

GREEDY_BELOW = 1e-5  # as vLLM (and shard/sampling.py): a smaller temperature is greedy, dividing by it overflows
MAX_STOP_CHARS = 1024  # per stop sequence: they are matched against the text after every token
MAX_CHOICES = 16  # best_of (TGI, OpenAI) and n (OpenAI): each choice is a request of its own
F32_TINY, F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # float32's smallest normal and largest


def _unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which are not text: the tokenizer raises a TypeError on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class Grammar(BaseModel):
    """TGI's `parameters.grammar`: json (a JSON schema; json_object is TGI's alias), json_schema ({"name", "schema"},
    as OpenAI's response_format carries it), regex, or (cb extension) lark, a Lark grammar as llguidance reads it."""
    type: Literal["json", "json_object", "json_schema", "regex", "lark"]
    value: Any = None


class Parameters(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    typical_p: Optional[float] = None
    do_sample: bool = False
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop: list[Text] = Field(default_factory=list)
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: Optional[int] = None
    top_n_tokens: Optional[int] = None
    best_of: Optional[int] = None
    watermark: bool = False
    ignore_eos: bool = Field(False, description="cb extension (as vLLM): keep generating past EOS")
    priority: int = Field(0, description="cb extension (as vLLM): lower is served first and evicted last")
    grammar: Optional[Grammar] = None


class GenerateRequest(BaseModel):
    inputs: Union[Text, list[int]] = Field(..., description="a prompt, or (cb extension) its token ids")
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = False


class ValidationError(Exception):
    pass


@dataclass
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    max_stop_sequences: int
    max_top_n_tokens: int


@dataclass
class Validated:
    input_ids: list[int]
    max_new_tokens: int
    sampling: pb.SamplingParameters
    stop: list[str]
    seed: Optional[int]
    grammar: Optional[Spec] = None  # compiled by the service (router/grammar.py)


def _check_parameters(p: Parameters, limits: Limits) -> None:
    """TGI's rules, with TGI's messages."""
    if p.best_of is not None and not 0 < p.best_of <= MAX_CHOICES:
        raise ValidationError(f"`best_of` must be > 0 and <= {MAX_CHOICES}. Given: {p.best_of}")
    if p.watermark:
        raise ValidationError("`watermark` is not supported")
    _check_sampling(p)
    _check_stop(p.stop, limits)
    if not -2**31 <= p.priority < 2**31:
        raise ValidationError("`priority` must be a 32-bit integer")
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                              f"Given: {p.top_n_tokens}")
    if p.truncate is not None and not 0 < p.truncate <= limits.max_input_tokens:
        raise ValidationError(f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
                              f"Given: {p.truncate}")


def _check_sampling(p: Parameters) -> None:
    if p.seed is not None and not 0 <= p.seed < 2**64:
        raise ValidationError("`seed` must be an unsigned 64-bit integer")
    if p.temperature is not None and p.temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2 <= p.frequency_penalty <= 2:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0 < p.top_p <= 1:
        raise ValidationError("`top_p` must be > 0.0 and <= 1.0")
    if p.typical_p is not None and not 0 < p.typical_p <= 1:
        raise ValidationError("`typical_p` must be > 0.0 and <= 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")


def _check_stop(stop: list[str], limits: Limits) -> None:
    if any(not s for s in stop):
        raise ValidationError("`stop` sequences cannot be empty")
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(stop)}")
    if (longest := max(map(len, stop), default=0)) > MAX_STOP_CHARS:
        raise ValidationError(f"`stop` sequences must be at most {MAX_STOP_CHARS} characters. Given: {longest}")


def _input_ids(req: GenerateRequest, tokenizer, limits: Limits) -> list[int]:
    if isinstance(req.inputs, str):
        if not req.inputs:
            raise ValidationError("`inputs` cannot be empty")
        return tokenizer(req.inputs, add_special_tokens=True)["input_ids"]
    if not req.inputs:
        raise ValidationError("`inputs` cannot be empty")
    if min(req.inputs) < 0 or max(req.inputs) >= limits.vocab_size:
        raise ValidationError(f"`inputs` token ids must be in [0, {limits.vocab_size})")
    return list(req.inputs)


def validate(req: GenerateRequest, tokenizer, limits: Limits) -> Validated:
    p = req.parameters
    _check_parameters(p, limits)
    ids = _input_ids(req, tokenizer, limits)
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    if len(ids) > limits.max_input_tokens:
        raise ValidationError(f"`inputs` tokens must be <= {limits.max_input_tokens}. Given: {len(ids)}")
    max_new = p.max_new_tokens if p.max_new_tokens is not None else limits.max_total_tokens - len(ids)
    if max_new <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(ids) + max_new > limits.max_total_tokens:
        raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                              f"Given: {len(ids)} `inputs` tokens and {max_new} `max_new_tokens`")
    params, seed = _sampling(p, limits.vocab_size)
    if (p.best_of or 1) > 1 and not params.do_sample:
        raise ValidationError("`best_of` > 1 needs sampling (`do_sample`, or a temperature, top_k, top_p or typical_p): "
                              "greedy choices would all be the same")
    return Validated(ids, max_new, params, list(p.stop), seed, grammar_spec(p.grammar))


def grammar_spec(g: Optional[Grammar]) -> Optional[Spec]:
    """What `parameters.grammar` asks for, checked for shape (the service compiles it)."""
    if g is None:
        return None
    try:
        if g.type in ("json", "json_object"):
            return Spec.json_schema({"type": "object"} if g.value is None and g.type == "json_object" else g.value)
        if g.type == "json_schema":
            if not isinstance(g.value, dict) or "schema" not in g.value:
                raise GrammarError('a json_schema grammar\'s value is {"name": ..., "schema": {...}}')
            return Spec.json_schema(g.value["schema"])
    except GrammarError as e:
        raise ValidationError(f"`grammar`: {e}") from None
    if not isinstance(g.value, str) or not g.value:
        raise ValidationError(f"`grammar`: a {g.type} grammar's value is a non-empty string")
    return Spec(g.type, g.value)


def _f32(x: Optional[float], default: float) -> float:
    """A positive value as float32 carries it: a tiny one would round to 0 (read as unset), a huge one to inf;
    the clamped value means the same to the sampler."""
    return default if x is None else min(max(x, F32_TINY), F32_MAX)


def _sampling(p: Parameters, vocab_size: int) -> tuple[pb.SamplingParameters, Optional[int]]:
    """The shards' parameters: a temperature below GREEDY_BELOW is greedy (vLLM), a top_k that keeps the whole
    vocabulary is no top_k (proto's uint32 could not carry every int anyway)."""
    tiny = p.temperature is not None and p.temperature < GREEDY_BELOW
    sampling = not tiny and (p.do_sample or p.temperature not in (None, 1.0) or bool(p.top_k)
                             or p.top_p not in (None, 1.0) or p.typical_p not in (None, 1.0))
    seed = None
    if sampling:
        seed = p.seed if p.seed is not None else random.randrange(2**63)
    params = pb.SamplingParameters(
        temperature=1.0 if tiny else _f32(p.temperature, 1.0),
        top_k=p.top_k if p.top_k and p.top_k < vocab_size else 0, top_p=_f32(p.top_p, 1.0),
        typical_p=_f32(p.typical_p, 1.0), do_sample=sampling, seed=seed or 0,
        repetition_penalty=_f32(p.repetition_penalty, 1.0), frequency_penalty=p.frequency_penalty or 0.0,
        top_n_tokens=p.top_n_tokens or 0, prefill_logprobs=p.decoder_input_details,
    )
    return params, seed
