"""Constrained decoding through the real clients (openai, text-generation) on the shared server: JSON schemas,
json_object, regexes, choices and tool calls; answers parse and validate, greedy and sampled; unconstrained
requests beside constrained ones keep transformers' greedy tokens; bad grammars are 422s that leave the server
serving."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from conftest import assert_idle
from test_api_errors import assert_error_shape, post

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a user of our website as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def person_format(schema=PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_json_schema_answers_validate(client, seed):
    """Nested objects, enums, arrays, bounded numbers, a pattern and required fields; greedy, then sampled."""
    sampled = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0}
    r = client.chat.completions.create(model="cb", messages=ASK, max_tokens=300, response_format=person_format(),
                                       **sampled)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_equals_non_streamed(client):
    kw = dict(model="cb", messages=ASK, max_tokens=300, temperature=0, response_format=person_format())
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole


def test_json_object_answers_parse(client):
    for prompt in ("Reply with a JSON object holding your name.", "What is 2+2? Answer in JSON with a key \"answer\".",
                   "Translate hello to French, as a JSON object."):
        r = client.chat.completions.create(model="cb", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=200, temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_response_format_and_structured_outputs(client):
    r = client.completions.create(model="cb", prompt="A user record:", max_tokens=300, temperature=0,
                                  extra_body={"response_format": person_format()})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model="cb", prompt="Is the sky blue? Answer:", max_tokens=8, seed=5,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
    assert r.choices[0].text in ("yes", "no", "maybe so") and r.choices[0].finish_reason == "stop"
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    r = client.completions.create(model="cb", prompt="The city and year:", max_tokens=30, temperature=0.8, seed=3,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_tgi_grammar_through_the_text_generation_client(server):
    tgi = Client(server.url, timeout=300)
    pattern = r" \(\d{3}\) \d{3}-\d{4}"
    out = tgi.generate("My phone number is", max_new_tokens=30, grammar=Grammar(type=GrammarType.Regex,
                                                                                value=pattern))
    assert re.fullmatch(pattern, out.generated_text), out.generated_text
    assert out.details.finish_reason.value == "eos_token"
    out = tgi.generate("A user record:", max_new_tokens=300, grammar=Grammar(type=GrammarType.Json, value=PERSON))
    jsonschema.validate(json.loads(out.generated_text), PERSON)
    streamed = "".join(r.token.text for r in tgi.generate_stream("A user record:", max_new_tokens=300,
                                                                 grammar=Grammar(type=GrammarType.Json, value=PERSON))
                       if not r.token.special)
    assert streamed == out.generated_text


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(server):
    body = {"inputs": "Pick a number:", "parameters": {"max_new_tokens": 20, "ignore_eos": True, "details": True,
                                                       "grammar": {"type": "regex", "value": " [0-9]{3}"}}}
    out = post(server.url, body).json()
    assert re.fullmatch(r" [0-9]{3}", out["generated_text"]) and out["details"]["finish_reason"] == "eos_token"
    assert out["details"]["generated_tokens"] < 20


def test_a_grammar_that_cannot_finish_ends_with_length(client):
    r = client.completions.create(model="cb", prompt="Say a:", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "a{50}"}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == "a" * len(r.choices[0].text)


def test_named_tool_call_validates_and_streams_the_same_call(client):
    kw = dict(model="cb", messages=ASK_WEATHER, max_tokens=100, temperature=0, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    name, arguments, ids, finish = None, "", set(), None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids |= {d.id} if d.id else set()
                name = d.function.name or name
                arguments += d.function.arguments or ""
    assert (name, json.loads(arguments), len(ids), finish) == (
        "get_weather", json.loads(call.function.arguments), 1, "tool_calls")


@pytest.mark.parametrize("seed", [None, 4])
def test_required_tool_call_is_one_of_the_tools(client, seed):
    sampled = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0}
    r = client.chat.completions.create(model="cb", messages=ASK_WEATHER, max_tokens=100, tools=[WEATHER, TIME],
                                       tool_choice="required", **sampled)
    (call,) = r.choices[0].message.tool_calls
    tool = {t["function"]["name"]: t for t in (WEATHER, TIME)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_history_is_accepted_and_auto_answers(client):
    """A past call and its result in the history; auto lets the model answer in text (or call again: then the
    call must name a tool)."""
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    r = client.chat.completions.create(model="cb", messages=history, max_tokens=60, temperature=0,
                                       tools=[WEATHER, TIME])
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    none = client.chat.completions.create(model="cb", messages=ASK_WEATHER, max_tokens=20, temperature=0,
                                          tools=[WEATHER], tool_choice="none")
    plain = client.chat.completions.create(model="cb", messages=ASK_WEATHER, max_tokens=20, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_unconstrained_requests_beside_constrained_ones_keep_greedy_tokens(server, reference):
    prompts = [reference.tokenizer(p)["input_ids"] for p in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,")]

    def constrained(i):
        body = {"inputs": "A user record:", "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": i,
                                                           "grammar": {"type": "json", "value": PERSON}}}
        return post(server.url, body).json()["generated_text"]

    with ThreadPoolExecutor(6) as pool:
        json_answers = [pool.submit(constrained, i) for i in range(3)]
        plain = [pool.submit(server.generate, ids, max_new_tokens=24, details=True) for ids in prompts]
        for ids, answer in zip(prompts, plain):
            reference.assert_same_greedy(ids, [t["id"] for t in answer.result()["details"]["tokens"]], 24)
        for a in json_answers:
            text = a.result()
            try:
                jsonschema.validate(json.loads(text), PERSON)
            except json.JSONDecodeError:  # 120 tokens may cut it short: what there is still follows the grammar
                assert text.startswith("{")
    assert_idle(server.url)


BAD_TGI = {
    "invalid regex": {"type": "regex", "value": "(ab"},
    "regex not a string": {"type": "regex", "value": 5},
    "schema not an object": {"type": "json", "value": [1, 2]},
    "schema not JSON": {"type": "json", "value": "{nope"},
    "unknown schema type": {"type": "json", "value": {"type": "nope"}},
    "json_schema without schema": {"type": "json_schema", "value": {"name": "x"}},
    "unknown grammar type": {"type": "xml", "value": "<a/>"},
    "too long a grammar": {"type": "regex", "value": "a" * 70_000},
    "invalid lark": {"type": "lark", "value": "start: undefined_rule"},
}


@pytest.mark.parametrize("case", sorted(BAD_TGI))
def test_bad_grammar_is_422_and_the_server_keeps_serving(server, case):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "grammar": BAD_TGI[case]}}
    err = assert_error_shape(post(server.url, body), "/generate")
    assert err["error_type"] == "validation" and "grammar" in err["error"], err
    assert server.generate("Hello", max_new_tokens=2)["generated_text"] is not None


def test_hostile_regex_is_bounded(server):
    """Nested repetition that would explode a naive matcher: refused or served, never a stall or a 5xx."""
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 8, "grammar": {
        "type": "regex", "value": "((a|b)*(c|d)*){1000}(x{1000}){1000}"}}}
    r = post(server.url, body, timeout=60)
    assert r.status_code in (200, 422), r.text
    assert_idle(server.url)
