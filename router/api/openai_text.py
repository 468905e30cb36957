"""OpenAI's text and logprobs: stop sequences cut from streamed text (OpenAI never shows them, TGI does), a
token's own text and bytes, logprobs in the chat and completions shapes, usage."""
from functools import lru_cache

from router.detokenizer import json_logprob
from router.job import Job, Token


class TextStream:
    """Streamed tokens → text deltas: special tokens dropped, a stop sequence and what follows cut off, and text
    that could be the start of a stop sequence held back until it is known not to be one."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.text = ""
        self.sent = 0

    def push(self, token: Token, finished: bool) -> str:
        if not token.special:
            self.text += token.text
        end = len(self.text)
        if self.stop:
            # Nothing sent so far can begin a stop sequence (it would have been held back), so search from `sent`.
            found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if found:
                end = min(found)
            elif not finished:
                # Only unsent text can be held back (by the same invariant), so only that much is tried: the
                # work per token is its own length, not the stop sequences' (up to MAX_STOP_CHARS each).
                unsent = end - self.sent
                end -= max((k for s in self.stop for k in range(1, min(len(s), unsent + 1))
                            if self.text.endswith(s[:k])), default=0)
        delta = self.text[self.sent:max(end, self.sent)]
        self.sent += len(delta)
        return delta


def cut_at_stop(text: str, stop: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(found)] if found else text


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet, reversed: a byte-level BPE token's characters → its raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_decoder()


class Vocab:
    """A token id's own text and bytes, as logprobs show them (the bytes of a token that is part of a
    multi-byte character are its raw bytes where the tokenizer is byte-level)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._get)

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = list(text.encode("utf-8"))
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in BYTE_DECODER for c in piece):
                raw = [BYTE_DECODER[c] for c in piece]
        return text, raw


def top_tokens(token: Token) -> list[Token]:
    # `Token.top_tokens` (best first) comes with TGI's top_n_tokens; absent, there are no alternatives to show.
    return list(getattr(token, "top_tokens", None) or [])


def chat_logprobs(vocab: Vocab, tokens: list[Token], top_n: int) -> dict:
    def entry(t: Token) -> dict:
        text, raw = vocab.get(t.id)
        return {"token": text, "logprob": json_logprob(t.logprob), "bytes": raw}
    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in top_tokens(t)[:top_n]]}
                        for t in tokens if not t.special]}


def completion_logprobs(vocab: Vocab, tokens: list[Token], top_n: int, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        if t.special:
            continue
        text = vocab.get(t.id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(json_logprob(t.logprob))
        out["top_logprobs"].append({vocab.get(a.id)[0]: json_logprob(a.logprob) for a in top_tokens(t)[:top_n]}
                                   if top_n else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def usage(jobs: list[Job]) -> dict:
    """The prompt once (its choices share it), every choice's tokens."""
    prompt, completion = len(jobs[0].request.prompt_ids), sum(len(job.tokens) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
