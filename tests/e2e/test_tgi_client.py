"""TGI's own PyPI client (`text_generation`), unchanged, against cb: generate, generate_stream, details, stop
sequences, seeds, its error mapping (validation, overloaded), and its chat call to the OpenAI route."""
import threading

import pytest
from text_generation import Client
from text_generation.errors import OverloadedError, ValidationError
from text_generation.types import Message

from conftest import Server, assert_idle

PROMPT = "The capital of France is"
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")  # the client's, not ours


@pytest.fixture(scope="module")
def client(server):
    return Client(server.url, timeout=300)


def greedy(reference, prompt, n):
    return reference.generate(reference.tokenizer(prompt)["input_ids"], n)


def test_generate_greedy_equals_transformers(client, reference):
    out = greedy(reference, PROMPT, 20)
    r = client.generate(PROMPT, max_new_tokens=20)
    assert r.generated_text == reference.tokenizer.decode(out, skip_special_tokens=True)
    assert [t.id for t in r.details.tokens] == out
    assert r.details.generated_tokens == len(out) and r.details.finish_reason.value == "length"
    assert all(t.logprob <= 0 for t in r.details.tokens) and r.details.seed is None


def test_generate_stream_equals_generate(client, reference):
    out = greedy(reference, PROMPT, 20)
    events = list(client.generate_stream(PROMPT, max_new_tokens=20))
    assert [e.token.id for e in events] == out
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == reference.tokenizer.decode(out, skip_special_tokens=True)
    assert last.details.generated_tokens == 20 and last.details.finish_reason.value == "length"
    assert "".join(e.token.text for e in events) == last.generated_text


def test_details_prompt_logprobs_and_top_tokens(client, reference):
    r = client.generate(PROMPT, max_new_tokens=4, decoder_input_details=True, top_n_tokens=2)
    assert [p.id for p in r.details.prefill] == reference.tokenizer(PROMPT)["input_ids"]
    assert r.details.prefill[0].logprob is None and all(p.logprob <= 0 for p in r.details.prefill[1:])
    assert len(r.details.top_tokens) == 4
    for token, top in zip(r.details.tokens, r.details.top_tokens):
        assert len(top) == 2 and top[0].id == token.id


def test_stop_sequences(client, reference):
    full = reference.tokenizer.decode(greedy(reference, PROMPT, 20), skip_special_tokens=True)
    stop = full.split()[2]
    r = client.generate(PROMPT, max_new_tokens=20, stop_sequences=[stop])
    assert r.details.finish_reason.value == "stop_sequence"
    # TGI keeps the stop sequence: the text ends within the token that completed it
    assert full.startswith(r.generated_text) and stop in r.generated_text
    assert stop not in r.generated_text[:len(r.generated_text) - len(r.details.tokens[-1].text)]
    events = list(client.generate_stream(PROMPT, max_new_tokens=20, stop_sequences=[stop]))
    assert events[-1].generated_text == r.generated_text
    assert events[-1].details.finish_reason.value == "stop_sequence"


def test_seeds(client):
    def sample(seed):
        r = client.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=1.0, seed=seed)
        assert r.details.seed == seed
        return r.generated_text
    assert sample(11) == sample(11)
    assert len({sample(s) for s in (11, 12, 13)}) > 1
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=16, do_sample=True, temperature=1.0, seed=11))
    assert streamed[-1].generated_text == sample(11)


@pytest.mark.parametrize("kw", [{"max_new_tokens": 5000}, {"max_new_tokens": 0}], ids=["too-many", "zero"])
def test_validation_error(client, kw):
    with pytest.raises(ValidationError):
        client.generate(PROMPT, **kw)
    with pytest.raises(ValidationError):
        list(client.generate_stream(PROMPT, **kw))


def test_too_long_prompt_is_a_validation_error(client):
    with pytest.raises(ValidationError, match="1024"):
        client.generate("hello " * 1500, max_new_tokens=2)


def test_chat_through_the_openai_route(client, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    out = reference.generate(ids, 16)
    r = client.chat([Message(**m) for m in messages], max_tokens=16, temperature=0)
    assert r.choices[0].message.content == reference.tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def small_server():
    s = Server("--max-concurrent-requests", "2", "--max-batch-total-tokens", "4096", "--max-total-tokens", "512",
               "--max-input-tokens", "256")
    yield s
    s.stop()


def test_overloaded(small_server):
    client = Client(small_server.url, timeout=300)
    barrier = threading.Barrier(8)
    results, errors = [], []

    def one():
        barrier.wait()
        try:
            results.append(client.generate(PROMPT, max_new_tokens=48))
        except OverloadedError as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors and results and len(errors) + len(results) == 8
    assert len(results) >= 2  # the two admitted first always run
    for r in results:  # every accepted request ran to its end
        assert r.details.finish_reason.value in ("length", "eos_token") and r.generated_text
        assert r.details.finish_reason.value == "eos_token" or r.details.generated_tokens == 48
    assert client.generate(PROMPT, max_new_tokens=2).details.generated_tokens == 2
    assert_idle(small_server.url)
