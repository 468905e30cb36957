"""Prefix reuse is real: a second request sharing a long prefix computes only its suffix, with the same tokens."""
from conftest import metric

PREFIX = ("Notes from the lighthouse keeper, written every evening by lamp light: the tide came in early, the "
          "gulls argued over the harbour, a fishing boat passed with red sails, and the wind turned north. ") * 5


def test_second_request_computes_only_its_suffix(server, reference):
    tok = reference.tokenizer
    first = tok(PREFIX + "What colour were the sails?")["input_ids"]
    second = tok(PREFIX + "Which way did the wind turn?")["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 160

    def run(ids):
        computed, hits = metric(server.url, "cb_computed_tokens_total"), metric(
            server.url, "cb_prefix_cache_hit_tokens_total")
        out = server.generate(ids, max_new_tokens=8, details=True)
        return ([t["id"] for t in out["details"]["tokens"]],
                metric(server.url, "cb_computed_tokens_total") - computed,
                metric(server.url, "cb_prefix_cache_hit_tokens_total") - hits)

    tokens1, computed1, hits1 = run(first)
    tokens2, computed2, hits2 = run(second)
    block = server.info()["block_size"]
    assert hits2 == shared // block * block and hits2 > hits1
    assert computed2 == len(second) - hits2 + 7       # the suffix, then 7 decode steps
    reference.assert_same_greedy(first, tokens1, 8)
    reference.assert_same_greedy(second, tokens2, 8)
