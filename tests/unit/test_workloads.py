"""cb-bench's pure parts: the W64 workload (in the repository, replayed exactly), arrivals, the random and text
workloads, and the statistics. No server, no timing thresholds."""
import math

import pytest

from bench.stats import parse_slos, percentile, side_by_side, summarize
from bench.workloads import arrival_times, load_w64, random_workload, text_workload, token_ids


def test_w64_is_replayed_exactly():
    reqs = load_w64()
    assert len(reqs) == 64
    assert sum(r.prompt_tokens for r in reqs) == 9046 and sum(r.max_new_tokens for r in reqs) == 8571
    assert all(r.inputs == r.prompt_ids for r in reqs)


def test_arrivals():
    assert arrival_times(3) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_times(2000, 10.0, "poisson", seed=1)
    assert poisson == sorted(poisson) and poisson == arrival_times(2000, 10.0, "poisson", seed=1)
    assert 150 < poisson[-1] < 250  # mean gap 0.1 s
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, "uniform")


def test_random_workload_lengths():
    reqs = random_workload(50, 100, 20, 0.5, seed=3)
    assert all(50 <= r.prompt_tokens <= 150 and 10 <= r.max_new_tokens <= 30 for r in reqs)
    assert all(len(r.prompt_ids) == r.prompt_tokens for r in reqs)


def rec(ttft, itl, tokens=None, error=None):
    tokens = tokens if tokens is not None else len(itl) + 1
    return {"id": 0, "prompt_tokens": 10, "max_new_tokens": tokens, "tokens": tokens, "ttft": ttft, "itl": itl,
            "e2e": (ttft or 0.0) + sum(itl), "error": error, "generated_tokens": tokens}


def test_summary_percentiles_goodput_and_errors():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    recs = [rec(0.1, [0.01, 0.01]), rec(0.5, [0.02, 0.04]), rec(None, [], tokens=0, error="overloaded: busy")]
    recs[2]["max_new_tokens"] = 3
    s = summarize(recs, wall=2.0, slos=parse_slos("ttft:200 tpot:50"))
    assert s["completed"] == 2 and s["errors_by_type"] == {"overloaded": 1} and s["mismatches"] == 1
    assert math.isclose(s["ttft_p50_ms"], 300) and math.isclose(s["itl_mean_ms"], 20)
    assert math.isclose(s["tpot_p50_ms"], 20) and s["good_requests"] == 1 and s["goodput_req_s"] == 0.5
    assert s["output_tokens"] == 6 and s["output_tok_s"] == 3.0
    with pytest.raises(ValueError):
        parse_slos("itl:5")
    assert "TTFT p99" in side_by_side([("cb", s), ("static", s)])


def test_text_workload(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\n\nThe capital of France is\n")
    reqs = text_workload(path, output_len=8, n=3)
    assert [r.inputs for r in reqs] == ["Hello there", "The capital of France is", "Hello there"]
    assert all(r.max_new_tokens == 8 and r.prompt_tokens == 0 for r in reqs)
    with pytest.raises(ValueError):
        token_ids(reqs[0])  # the baselines need ids: a tokenizer must have been given

    def fake_tokenizer(text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}
    reqs = text_workload(path, output_len=8, tokenizer=fake_tokenizer)
    assert [r.prompt_tokens for r in reqs] == [2, 5] and token_ids(reqs[1]) == [3, 7, 2, 6, 2]
