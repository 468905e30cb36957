"""Step sizes are padded to a few dozen buckets (shard/layout.py), each at most 7 rows or 12.5% over."""
from shard.layout import bucket


def test_buckets_cover_every_size_with_bounded_padding():
    sizes = range(1, 8193)
    padded = [bucket(n) for n in sizes]
    assert all(p >= n for n, p in zip(sizes, padded))
    assert all(a <= b for a, b in zip(padded, padded[1:]))
    assert all(p - n <= 7 or p <= n * 1.125 for n, p in zip(sizes, padded))
    assert len(set(padded)) <= 70
    assert all(bucket(p) == p for p in padded)
