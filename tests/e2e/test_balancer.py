"""Replicas behind an existing balancer: two cb replicas on loopback behind SGLang's Rust balancer (sglang-router),
the shared-prefix workload through it one request at a time under round robin, then (with passages of its own)
under its cache-aware policy. Every request is answered through it, and cache-aware routing reuses more of the
replicas' prefix caches: each passage stays on one replica, where round robin computes it on both.
"""
from bench.balancer import measure, start_balancer
from bench.fresh import stop
from bench.workloads import shared_prefix_workload
from conftest import Server, free_port


def test_two_replicas_behind_sglang_router_answer_everything_and_cache_aware_hits_more():
    replicas = [Server("--max-batch-total-tokens", "4096", wait=False) for _ in range(2)]
    try:
        for r in replicas:
            r.wait_ready()
        urls = [r.url for r in replicas]
        results = {}
        for seed, policy in enumerate(("round_robin", "cache_aware")):
            port = free_port()
            balancer = start_balancer(policy, urls, port)
            try:
                reqs = shared_prefix_workload(docs=3, questions=4, doc_words=120, max_new_tokens=4, seed=seed)
                results[policy] = measure(f"http://127.0.0.1:{port}", urls, reqs, concurrency=1)
            finally:
                stop(balancer)
        for policy, s in results.items():
            assert s["completed"] == s["requests"] == 12 and s["errors"] == 0, (policy, s["errors_by_type"])
            assert sum(s["served_per_replica"]) == 12, (policy, s["served_per_replica"])
        assert results["round_robin"]["served_per_replica"] == [6, 6]
        assert results["cache_aware"]["hit_rate"] > results["round_robin"]["hit_rate"], \
            {p: s["hit_rate"] for p, s in results.items()}
    finally:
        for r in replicas:
            r.stop()
