"""Constrained decoding's pure parts, on SmolLM2's real tokenizer (no model, no server): llguidance reads the
GGUF's byte-level vocabulary right (a space is a space), masks allow exactly what the grammar can continue with,
a complete grammar says so, bad grammars are GrammarErrors, and a tool-call stream splits into OpenAI's deltas."""
import json

import pytest
from transformers import AutoTokenizer

from launcher.model_files import resolve_model
from router.api.openai_tools import Tools, ToolStream, parse
from router.grammar import MAX_GRAMMAR_CHARS, GrammarError, Grammars, Spec


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def allowed(constraint) -> set[int]:
    mask = constraint.allowed()
    return {t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1}


def test_a_document_in_the_json_style_is_accepted_token_by_token(tokenizer, grammars):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    c = grammars.compile(Spec.json_schema(schema))
    for token in tokenizer('{"name": "héllo wörld 🙂", "n": 12}', add_special_tokens=False)["input_ids"]:
        assert not c.complete and token in allowed(c)
        assert c.accept(token)
    assert c.complete and allowed(c) == {tokenizer.eos_token_id}


def test_masks_allow_exactly_the_grammar(tokenizer, grammars):
    c = grammars.compile(Spec("regex", "(yes|no)"))
    texts = {tokenizer.decode([t]) for t in allowed(c)}
    assert texts and all("yes".startswith(x) or "no".startswith(x) for x in texts), texts
    assert not c.accept(tokenizer(" maybe", add_special_tokens=False)["input_ids"][0])


@pytest.mark.parametrize("spec", [Spec("regex", "(ab"), Spec("lark", "start: nowhere"),
                                  Spec("regex", "a" * (MAX_GRAMMAR_CHARS + 1)),
                                  Spec("json", json.dumps({"type": "x"}))])
def test_bad_grammars_are_grammar_errors(grammars, spec):
    with pytest.raises(GrammarError):
        grammars.compile(spec)


def test_compiled_grammars_are_shared_but_matchers_are_not(grammars, tokenizer):
    a, b = grammars.compile(Spec("regex", "[0-9]+")), grammars.compile(Spec("regex", "[0-9]+"))
    assert a.accept(tokenizer("7", add_special_tokens=False)["input_ids"][0])
    eos = tokenizer.eos_token_id
    assert eos in allowed(a) and eos not in allowed(b)  # b is still at the start: a digit must come first


TOOLS = Tools([{"name": "get_weather", "parameters": {"type": "object"}}, {"name": "get_time"}], "required")


def deltas(stream: ToolStream, pieces: list[str]) -> list[dict]:
    return [d for i, p in enumerate(pieces) for d in stream.push(p, i == len(pieces) - 1)]


def test_a_constrained_call_streams_its_name_then_its_arguments():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    out = deltas(ToolStream(TOOLS), [text[i:i + 5] for i in range(0, len(text), 5)])
    head, rest = out[0]["tool_calls"][0], out[1:]
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest) == '{"city": "Paris"}'
    assert parse(text, TOOLS)[1][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_auto_streams_text_until_a_tool_call_tag():
    auto = Tools(TOOLS.functions, "auto")
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>'
    out = deltas(ToolStream(auto), [text[i:i + 3] for i in range(0, len(text), 3)])
    content = "".join(d.get("content", "") for d in out)
    calls = [c for d in out for c in d.get("tool_calls", [])]
    assert content == "Let me check. " and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"timezone": "UTC"}'}
    assert parse(text, auto)[0] == "Let me check."
    plain = "No <tool_ call here"
    assert "".join(d.get("content", "") for d in deltas(ToolStream(auto), list(plain))) == plain
    bad = 'x <tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert parse(bad, auto) == (bad, [])
