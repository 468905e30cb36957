"""The OpenAI surface, driven by the real `openai` client: chat and completions, streamed and not, against
transformers' own greedy output; n=17, stop, logprobs, usage, seeds, ignore_eos, errors in OpenAI's shape, bad and
hostile fields."""
import httpx
import openai
import pytest

from conftest import assert_idle
from router.job import Token
from test_api_errors import HUGE, INF, NAN, assert_error_shape, post, strict_json

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def ref_chat(reference, messages, n):
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids, reference.generate(ids, n)


def ref_completion(reference, prompt, n):
    ids = reference.tokenizer(prompt)["input_ids"]
    return ids, reference.generate(ids, n)


def decode(reference, ids):
    return reference.tokenizer.decode(ids, skip_special_tokens=True)


def expected_finish(reference, out, n):
    return "stop" if out and out[-1] == reference.tokenizer.eos_token_id and len(out) <= n else "length"


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.info()["model_id"]] == ["smollm2"]  # what was asked for, not a path
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_chat_greedy_equals_transformers(client, reference):
    r = client.chat.completions.create(model="cb", messages=CHAT, max_tokens=24, temperature=0)
    ids, out = ref_chat(reference, CHAT, 24)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == decode(reference, out)
    assert choice.finish_reason == expected_finish(reference, out, 24)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
    assert r.usage.total_tokens == len(ids) + len(out)
    assert r.object == "chat.completion" and r.model


def test_chat_stream_with_usage(client, reference):
    chunks = list(client.chat.completions.create(model="cb", messages=CHAT, max_completion_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    ids, out = ref_chat(reference, CHAT, 24)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == decode(reference, out)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected_finish(reference, out, 24)]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(out)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_completion_greedy_equals_transformers(client, reference, as_ids):
    ids, out = ref_completion(reference, PROMPT, 20)
    r = client.completions.create(model="cb", prompt=ids if as_ids else PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == decode(reference, out)
    assert r.choices[0].finish_reason == expected_finish(reference, out, 20)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out))


def test_completion_stream_with_usage(client, reference):
    ids, out = ref_completion(reference, PROMPT, 20)
    chunks = list(client.completions.create(model="cb", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == decode(reference, out)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_stream_without_usage_has_none(client):
    chunks = list(client.completions.create(model="cb", prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stream_ends_with_done(server):
    body = {"model": "cb", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_n_17_is_a_422_in_openai_shape(client, route, stream):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        if route == "chat":
            client.chat.completions.create(model="cb", messages=CHAT, max_tokens=4, n=17, stream=stream)
        else:
            client.completions.create(model="cb", prompt=PROMPT, max_tokens=4, n=17, stream=stream)
    assert e.value.status_code == 422
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "n" and "`n`" in err["message"]


def test_stop_cuts_the_text_before_the_stop_sequence(client, reference):
    _, out = ref_completion(reference, PROMPT, 20)
    full = decode(reference, out)
    stop = full.split()[2]  # a word in the middle of the greedy continuation
    expected = full[:full.index(stop)]
    r = client.completions.create(model="cb", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="cb", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_chat_stop(client, reference):
    _, out = ref_chat(reference, CHAT, 24)
    full = decode(reference, out)
    stop = full.split()[1]
    r = client.chat.completions.create(model="cb", messages=CHAT, max_tokens=24, temperature=0, stop=stop)
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


HAS_TOP_TOKENS = "top_tokens" in getattr(Token, "__dataclass_fields__", {})


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="cb", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for t in content:
        assert t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        if HAS_TOP_TOKENS:  # greedy: the best alternative is the chosen token
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_chat_logprobs_streamed(client):
    chunks = list(client.chat.completions.create(model="cb", messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True))
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(t.token for t in content) == text and len(content) >= 1


def test_completion_logprobs(client):
    r = client.completions.create(model="cb", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens == 10
    assert "".join(lp.tokens) == r.choices[0].text and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(r.choices[0].text) - len(lp.tokens[-1])
    if HAS_TOP_TOKENS:
        assert all(len(top) == 1 and list(top) == [tok] for top, tok in zip(lp.top_logprobs, lp.tokens))


def test_no_logprobs_unless_asked(client):
    r = client.completions.create(model="cb", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


def test_seed_and_sampling(client):
    def sample(seed, **kw):
        return client.completions.create(model="cb", prompt=PROMPT, max_tokens=16, seed=seed, **kw).choices[0].text
    assert sample(7) == sample(7)  # default temperature 1.0 samples
    assert len({sample(s) for s in (1, 2, 3)}) > 1
    assert sample(7, temperature=0) == sample(8, temperature=0)  # temperature 0 is greedy, seed moot


def test_ignore_eos(client):
    short = client.chat.completions.create(model="cb", messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    long = client.chat.completions.create(model="cb", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 40


def test_chat_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    a = client.chat.completions.create(model="cb", messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model="cb", messages=CHAT, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


BAD = {
    "temperature below 0": ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    "temperature NaN": ("chat", {"messages": CHAT, "temperature": NAN}, "temperature"),
    "temperature 1e400": ("completions", {"prompt": PROMPT, "temperature": HUGE}, "temperature"),
    "temperature 'NaN' as a string": ("completions", {"prompt": PROMPT, "temperature": "NaN"}, "temperature"),
    "repetition_penalty NaN": ("completions", {"prompt": PROMPT, "repetition_penalty": NAN}, "repetition_penalty"),
    "repetition_penalty 0": ("chat", {"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    "top_p Infinity": ("chat", {"messages": CHAT, "top_p": INF}, "top_p"),
    "frequency_penalty 'NaN' as a string": ("chat", {"messages": CHAT, "frequency_penalty": "NaN"},
                                            "frequency_penalty"),
    "frequency_penalty 2.5": ("completions", {"prompt": PROMPT, "frequency_penalty": 2.5}, "frequency_penalty"),
    "presence_penalty NaN": ("completions", {"prompt": PROMPT, "presence_penalty": NAN}, "presence_penalty"),
    "presence_penalty 1": ("chat", {"messages": CHAT, "presence_penalty": 1}, "presence_penalty"),
    "logit_bias NaN": ("completions", {"prompt": PROMPT, "logit_bias": {"1": NAN}}, "logit_bias"),
    "logit_bias given": ("chat", {"messages": CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    "top_k -2": ("completions", {"prompt": PROMPT, "top_k": -2}, "top_k"),
    "seed -1": ("completions", {"prompt": PROMPT, "seed": -1}, "seed"),
    "seed 2**64": ("chat", {"messages": CHAT, "seed": 2**64}, "seed"),
    "n 0": ("completions", {"prompt": PROMPT, "n": 0}, "n"),
    "n 2**64": ("chat", {"messages": CHAT, "n": 2**64}, "n"),
    "max_tokens 0": ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    "max_tokens -1": ("chat", {"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    "max_tokens 2**64": ("completions", {"prompt": PROMPT, "max_tokens": 2**64}, "max_tokens"),
    "max_completion_tokens 0": ("chat", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    "max_completion_tokens beyond": ("chat", {"messages": CHAT, "max_completion_tokens": 5000},
                                     "max_completion_tokens"),
    "stop sequence too long": ("completions", {"prompt": PROMPT, "stop": "x" * 1025}, "1024"),
    "too many stop sequences": ("chat", {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "stop a number": ("completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    "priority 2**40": ("completions", {"prompt": PROMPT, "priority": 2**40}, "priority"),
    "best_of 0": ("completions", {"prompt": PROMPT, "best_of": 0}, "best_of"),
    "best_of below n": ("completions", {"prompt": PROMPT, "best_of": 2, "n": 3}, "best_of"),
    "best_of streamed": ("completions", {"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of"),
    "suffix": ("completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
    "echo with logprobs": ("completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo"),
    "token id out of vocabulary": ("completions", {"prompt": [1, 2**40]}, "prompt"),
    "negative token id": ("completions", {"prompt": [[-1]]}, "prompt"),
    "prompt a number": ("completions", {"prompt": 5}, "prompt"),
    "lone surrogate in prompt": ("completions", {"prompt": ["a\ud800"]}, "prompt"),
    "lone surrogate in a message": ("chat", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    "missing prompt": ("completions", {}, "prompt"),
    "messages not a list": ("chat", {"messages": "hi"}, "messages"),
    "message without role": ("chat", {"messages": [{"content": "hi"}]}, "messages"),
    "content a number": ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    "tools": ("chat", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    "response_format xml": ("chat", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    "json_schema without a schema": ("chat", {"messages": CHAT, "response_format": {"type": "json_schema"}},
                                     "response_format"),
    "invalid JSON schema": ("chat", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format"),
    "invalid regex": ("completions", {"prompt": PROMPT, "structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    "two structured outputs": ("completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
                               "structured_outputs"),
    "tool_choice names no tool": ("chat", {"messages": CHAT, "tool_choice": {"type": "function", "function": {
        "name": "f"}}, "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice"),
    "tool_choice without tools": ("chat", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    "tool parameters invalid": ("chat", {"messages": CHAT, "tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}}]}, "tools"),
    "stream_options a list": ("chat", {"messages": CHAT, "stream": True, "stream_options": []}, "stream_options"),
    "logprobs -1": ("completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    "top_logprobs -1": ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "beyond max_total_tokens": ("completions", {"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
    "too long a prompt": ("completions", {"prompt": "hello " * 1500}, "prompt"),
    "empty prompt": ("completions", {"prompt": ""}, "prompt"),
    "batched prompts": ("completions", {"prompt": ["a", "b"]}, "prompt"),
    "top_p above 1": ("completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    "empty messages": ("chat", {"messages": []}, "messages"),
    "image content": ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    "top_logprobs without logprobs": ("chat", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    "top_logprobs 21": ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "logprobs 6": ("completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    "missing messages": ("chat", {}, "messages"),
    "wrong type": ("chat", {"messages": CHAT, "max_tokens": "many"}, "max_tokens"),
}


def openai_body(route: str, body: dict) -> dict:
    """A request with a model and, unless the case sets one, a small max_tokens (a valid one finishes fast)."""
    small = {} if {"max_tokens", "max_completion_tokens"} & set(body) else {"max_tokens": 4}
    return {"model": "cb", **small, **body}


def path_of(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_422_in_openai_shape(server, case):
    route, body, word = BAD[case]
    err = assert_error_shape(post(server.url, openai_body(route, body), path_of(route)), path_of(route))
    assert err["code"] == "validation"
    assert word in err["message"], err["message"]


@pytest.mark.parametrize("case", ["logprobs -1", "top_logprobs -1", "temperature NaN", "max_completion_tokens 0",
                                  "seed 2**64", "stop sequence too long", "token id out of vocabulary"])
def test_bad_request_names_its_param(server, case):
    route, body, _ = BAD[case]
    err = post(server.url, openai_body(route, body), path_of(route)).json()["error"]
    assert err["param"] == {"stop sequence too long": "stop", "token id out of vocabulary": "prompt"}.get(
        case, case.split()[0]), err


# Accepted, and each must generate (they used to be a 500, or a sampler failure that took the batch down).
HOSTILE = {
    "top_k 2**40": ("completions", {"prompt": PROMPT, "top_k": 2**40}),
    "top_k -1 (every token)": ("chat", {"messages": CHAT, "top_k": -1, "seed": 1}),
    "top_k 0 (every token)": ("completions", {"prompt": PROMPT, "top_k": 0}),
    "temperature 1e-38": ("completions", {"prompt": PROMPT, "temperature": 1e-38}),
    "temperature 1e308": ("chat", {"messages": CHAT, "temperature": 1e308}),
    "repetition_penalty 1e-38": ("completions", {"prompt": PROMPT, "repetition_penalty": 1e-38, "logprobs": 5}),
    "repetition_penalty 1e308": ("chat", {"messages": CHAT, "repetition_penalty": 1e308, "logprobs": True,
                                          "top_logprobs": 5}),
    "top_p 1e-45": ("completions", {"prompt": PROMPT, "top_p": 1e-45, "stream": True}),
    "top_k 1 with logprobs": ("completions", {"prompt": PROMPT, "top_k": 1, "logprobs": 3, "stream": True}),
    "unknown fields": ("chat", {"messages": CHAT, "guided_json": {"x": 1}, "foo": None}),
    "longest stop sequence": ("chat", {"messages": CHAT, "stop": ["z" * 1024], "stream": True}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fields_generate(server, case):
    route, body = HOSTILE[case]
    r = post(server.url, openai_body(route, body), path_of(route))
    assert r.status_code == 200, r.text[:500]
    if body.get("stream"):
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and all("error" not in strict_json(x) for x in lines[:-1])
    else:
        assert strict_json(r.text)["usage"]["completion_tokens"] >= 1


def test_masked_alternatives_are_finite_logprobs(client):
    r = client.completions.create(model="cb", prompt=PROMPT, max_tokens=3, logprobs=3, extra_body={"top_k": 1})
    for top in r.choices[0].logprobs.top_logprobs:
        assert sorted(top.values())[:2] == [-9999.0, -9999.0]
    assert all(x == pytest.approx(0.0, abs=1e-5) for x in r.choices[0].logprobs.token_logprobs)


def test_tiny_temperature_is_greedy(client):
    def text(temperature):
        return client.completions.create(model="cb", prompt=PROMPT, max_tokens=8, temperature=temperature,
                                         seed=3).choices[0].text
    assert text(1e-38) == text(0)


@pytest.mark.parametrize("max_tokens", ["absent", None])
def test_completion_max_tokens_defaults_to_16(server, max_tokens):
    body = {"model": "cb", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    if max_tokens != "absent":
        body["max_tokens"] = max_tokens
    r = post(server.url, body, "/v1/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_malformed_json_is_openai_shaped(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["type"] == "invalid_request_error"


def test_abandoned_stream_is_cancelled(client, server):
    stream = client.completions.create(model="cb", prompt=PROMPT, max_tokens=1000, temperature=0,
                                       extra_body={"ignore_eos": True}, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert_idle(server.url)
