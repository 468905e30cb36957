"""Turns a growing list of token ids into text pieces that are safe to stream, and finds stop sequences.

A piece is emitted only once the tokens decode to whole characters (TGI's prefix/read offsets), so a
multi-byte character split across tokens never streams as a replacement character. `json_logprob` makes a
token's logprob safe to send.
"""
import math
from typing import Optional

from tokenizers.decoders import DecodeStream

IMPOSSIBLE_LOGPROB = -9999.0  # what vLLM shows for a token of probability 0


def json_logprob(logprob: Optional[float]) -> Optional[float]:
    """A logprob JSON can carry (it has no NaN or Infinity; Starlette refuses them with a 500, json.dumps
    writes invalid JSON): -inf becomes IMPOSSIBLE_LOGPROB, NaN (a prompt's first token) and +inf null."""
    if logprob is None or math.isfinite(logprob):
        return logprob
    return IMPOSSIBLE_LOGPROB if logprob < 0 else None


class Detokenizer:
    def __init__(self, tokenizer, prompt_tail: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""
        self._stream, self._backend = None, getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None and not tokenizer.decode(self.ids).endswith("\ufffd"):
            self._stream = DecodeStream(skip_special_tokens=False)
            for token_id in self.ids:  # the prompt's tail: context for the first pieces, never sent
                self._stream.step(self._backend, token_id)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly empty). A fast tokenizer's own streaming
        decoder gives the same pieces ~8x cheaper (the router detokenizes a whole batch between two steps); it
        is not used when the prompt ends inside a character, where it would send that character's first bytes."""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id) or ""
            self.text += piece
            return piece
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += piece
            return piece
        return ""

    def stopped(self, piece: str) -> bool:
        """Whether a stop sequence ends within the text seen so far, counting the latest piece."""
        if not piece:
            return False
        window = max((len(s) for s in self.stop), default=0) + len(piece)
        tail = self.text[-window:]
        return any(s in tail for s in self.stop)
