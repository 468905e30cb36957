"""The router's detokenizer streams the same pieces through the fast tokenizer's DecodeStream as through its
general path (the window decoded twice per token), over text full of multi-byte characters split across
tokens, whatever prompt tail precedes it. Needs the SmolLM2 tokenizer files (not the model), no torch."""
import random

import pytest
from transformers import AutoTokenizer

from launcher.model_files import resolve_model
from router.detokenizer import Detokenizer


class General:
    """The same tokenizer without its Rust backend: the Detokenizer's general path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def texts():
    rng = random.Random(0)
    yield "Hello, world! Ça va? 日本語のテキスト 🙂🚀 — naïve café\n\n  indented\tcode()"
    yield "<|im_start|>assistant\nSure!<|im_end|> ok"
    for _ in range(6):
        yield "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(200))
    yield "".join(chr(rng.randrange(0x1F300, 0x1F600)) for _ in range(60))


def test_fast_and_general_paths_stream_the_same_pieces(tokenizer):
    fast_used = 0
    for text in texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(8):
            tail, generated = ids[max(0, cut - 5):cut], ids[cut:]
            fast, general = Detokenizer(tokenizer, tail, []), Detokenizer(General(tokenizer), tail, [])
            fast_used += fast._stream is not None
            assert [fast.add(i) for i in generated] == [general.add(i) for i in generated]
            assert fast.text == general.text
            assert "\ufffd" not in fast.text or "\ufffd" in tokenizer.decode(generated)
    assert fast_used > 20  # most tails end on a whole character: the fast path ran
