"""OpenAI's request shapes and errors, and how a request becomes a TGI-shaped `Parameters` and prompt."""
import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from router.api.errors import APIError
from router.api.openai_tools import Tools, native_call, render_call
from router.api.service import Service
from router.api.validation import GREEDY_BELOW, MAX_CHOICES, Grammar, Parameters, Text

FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's own limits (the router's may be lower)
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM


def invalid(message: str, param: Optional[str] = None) -> APIError:
    return APIError(422, message, "validation", param)


# ---- request shapes -------------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (extra_body): one of a JSON schema, a regex, a list of choices, a Lark grammar."""
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Optional[Text] = None
    choice: Optional[list[Text]] = None
    grammar: Optional[Text] = None


class Common(BaseModel):
    """Fields both routes take. Unknown fields are ignored, as vLLM does; declared ones cb does not support are
    refused with a 422 (see to_parameters). Floats must be finite."""
    model_config = ConfigDict(allow_inf_nan=False)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[Text, list[Text], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extensions
    ignore_eos: bool = False
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = None
    priority: int = 0
    structured_outputs: Optional[StructuredOutputs] = None
    # OpenAI's on chat; vLLM takes it on completions too
    response_format: Optional[dict[str, Any]] = None


class ChatMessage(BaseModel):
    role: Text
    content: Union[Text, list[dict[str, Any]], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's past calls
    tool_call_id: Optional[Text] = None  # a tool message: the call it answers


class ChatCompletionRequest(Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None


class CompletionRequest(Common):
    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


# ---- translating a request -------------------------------------------------------------------------------------

def check_top_logprobs(value: Optional[int], most: int, field: str) -> None:
    if value is not None and not 0 <= value <= most:
        raise invalid(f"`{field}` must be in [0, {most}]. Given: {value}", field)


def _check(req: Common, max_tokens: Optional[int], max_tokens_field: str) -> None:
    """The rules OpenAI's fields add to TGI's (validation.py checks the rest once both are Parameters)."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"`n` must be between 1 and {MAX_CHOICES} (got {req.n})", "n")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"`{max_tokens_field}` must be at least 1", max_tokens_field)
    if req.temperature is not None and req.temperature < 0:
        raise invalid("`temperature` must be >= 0", "temperature")
    if req.top_k is not None and req.top_k < -1:
        raise invalid("`top_k` must be -1 or 0 (every token) or positive", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**64:
        raise invalid("`seed` must be in [0, 2**64)", "seed")
    if req.presence_penalty:
        raise invalid("`presence_penalty` is not supported (use `frequency_penalty`)", "presence_penalty")
    if req.logit_bias:
        raise invalid("`logit_bias` is not supported", "logit_bias")


def to_parameters(req: Common, max_tokens: Optional[int], top_n: int,
                  max_tokens_field: str = "max_tokens") -> Parameters:
    _check(req, max_tokens, max_tokens_field)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # OpenAI's and vLLM's meaning: a temperature of 0 (below vLLM's epsilon) is greedy, top_p/top_k/seed moot
    greedy = req.temperature is not None and req.temperature < GREEDY_BELOW
    extra = {"top_n_tokens": top_n} if top_n and "top_n_tokens" in Parameters.model_fields else {}
    return Parameters(
        max_new_tokens=max_tokens, do_sample=not greedy,
        temperature=None if greedy else req.temperature, top_p=None if greedy else req.top_p,
        top_k=None if greedy or req.top_k in (-1, 0) else req.top_k, seed=req.seed,
        frequency_penalty=req.frequency_penalty or None, repetition_penalty=req.repetition_penalty,
        stop=[s for s in stop if s], ignore_eos=req.ignore_eos, priority=req.priority, details=True,
        grammar=grammar(req), **extra,
    )


def grammar(req: Common) -> Optional[Grammar]:
    """`response_format` (OpenAI) or `structured_outputs` (vLLM) as TGI's `parameters.grammar`."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.get("type", "text") != "text" and so is not None:
        raise invalid("give `response_format` or `structured_outputs`, not both", "response_format")
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar(type="json", value={"type": "object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise invalid('`response_format` json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                              "response_format")
            return Grammar(type="json", value=spec["schema"])
        raise invalid(f"`response_format` type must be text, json_object or json_schema (got {kind!r})",
                      "response_format")
    if so is None:
        return None
    given = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
             if v is not None]
    if len(given) != 1:
        raise invalid(f"`structured_outputs` takes exactly one of json, regex, choice, grammar (got {given})",
                      "structured_outputs")
    if so.choice is not None:
        if not so.choice or not all(so.choice):
            raise invalid("`structured_outputs.choice` must list non-empty strings", "structured_outputs")
        return Grammar(type="lark", value="start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice))
    if so.grammar is not None:
        return Grammar(type="lark", value=so.grammar)
    return Grammar(type="regex", value=so.regex) if so.regex is not None else Grammar(type="json", value=so.json_)



def message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"messages[{i}]: only text content parts are supported (got {part.get('type')!r})",
                          "messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(svc: Service, req: ChatCompletionRequest, tools: Optional[Tools] = None) -> list[int]:
    """The conversation through the model's chat template; with tools, as openai_tools.py renders them."""
    if not req.messages:
        raise invalid("`messages` cannot be empty", "messages")
    if getattr(svc.tokenizer, "chat_template", None) is None:
        raise invalid("this model has no chat template: use /v1/completions", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        msg = {"role": m.role, "content": message_text(m, i)}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls and tools is not None and tools.native:
            msg["tool_calls"] = [native_call(c) for c in m.tool_calls]
        elif m.tool_calls:
            msg["content"] += "".join(render_call(c) for c in m.tool_calls if isinstance(c, dict))
        messages.append(msg)
    extra = {}
    if tools is not None and tools.native:
        extra["tools"] = [{"type": "function", "function": f} for f in tools.functions]
    elif tools is not None:
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt()}
        else:
            messages.insert(0, {"role": "system", "content": tools.system_prompt()})
    try:
        ids = svc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    except Exception as e:  # jinja2's TemplateError (a template's raise_exception), ValueError, TypeError
        raise invalid(f"the chat template refused these messages: {e}", "messages") from e
    if not isinstance(ids, list):  # a BatchEncoding where transformers returns a dict
        ids = ids["input_ids"]
    return list(ids)


def completion_prompt(req: CompletionRequest) -> Union[str, list[int]]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise invalid(f"one prompt per request: got {len(p)} (batched prompts are not supported)", "prompt")
        p = p[0]
    if not p:
        raise invalid("`prompt` cannot be empty", "prompt")
    if req.suffix:
        raise invalid("`suffix` is not supported", "suffix")
    if req.best_of is not None and not (req.n or 1) <= req.best_of <= MAX_CHOICES:
        raise invalid(f"`best_of` must be at least `n` ({req.n or 1}) and at most {MAX_CHOICES} (got {req.best_of})",
                      "best_of")
    if req.best_of is not None and req.best_of > (req.n or 1) and req.stream:
        raise invalid("`best_of` greater than `n` cannot be streamed (the best are known only at the end)", "best_of")
    if req.echo and req.logprobs is not None:
        raise invalid("`echo` with `logprobs` is not supported (no prompt logprobs)", "echo")
    return p


def max_top_logprobs(svc: Service, route: str) -> int:
    return min(MAX_TOP_LOGPROBS[route], svc.limits.max_top_n_tokens)
