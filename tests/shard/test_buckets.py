"""Step sizes, and decode groups' sizes and widths, are padded to a few dozen buckets (shard/layout.py): at
most fine - 1 over, or 12.5% beyond 16 * fine."""
import pytest

from shard.layout import bucket


@pytest.mark.parametrize("fine", [4, 8])
def test_buckets_cover_every_size_with_bounded_padding(fine):
    sizes = range(1, 8193)
    padded = [bucket(n, fine) for n in sizes]
    assert all(p >= n for n, p in zip(sizes, padded))
    assert all(a <= b for a, b in zip(padded, padded[1:]))
    assert all(p - n < fine or p <= n * 1.125 for n, p in zip(sizes, padded))
    assert len(set(padded)) <= 80
    assert all(bucket(p, fine) == p for p in padded)
