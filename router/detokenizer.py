"""Turns a growing list of token ids into text pieces that are safe to stream, and finds stop sequences.

A piece is emitted only once the tokens decode to whole characters (TGI's prefix/read offsets), so a
multi-byte character split across tokens never streams as a replacement character. `json_logprob` makes a
token's logprob safe to send.
"""
import math
from typing import Optional

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

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly empty)."""
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
