"""Step sizes, and decode groups' sizes and widths, are padded to a few dozen buckets (shard/layout.py): at
most fine - 1 over, or 12.5% beyond 16 * fine; decodes of very different widths go in separate groups."""
import pytest

from shard.layout import GROUP_OVERHEAD, bucket, split_decodes


@pytest.mark.parametrize("fine", [4, 8])
def test_buckets_cover_every_size_with_bounded_padding(fine):
    sizes = range(1, 8193)
    padded = [bucket(n, fine) for n in sizes]
    assert all(p >= n for n, p in zip(sizes, padded))
    assert all(a <= b for a, b in zip(padded, padded[1:]))
    assert all(p - n < fine or p <= n * 1.125 for n, p in zip(sizes, padded))
    assert len(set(padded)) <= 80
    assert all(bucket(p, fine) == p for p in padded)


class _State:
    def __init__(self, blocks: int):
        self.blocks = list(range(blocks))


def _decodes(widths: list[int]) -> list[tuple]:
    return [(i, 1, _State(w)) for i, w in enumerate(sorted(widths))]


def test_decodes_of_one_width_stay_one_group():
    members = _decodes([9] * 40)
    assert split_decodes(members) == [members]


def test_decodes_of_spread_widths_are_cut_where_padding_is_saved():
    members = _decodes([2] * 24 + [40] * 8)
    groups = split_decodes(members)
    assert [len(g) for g in groups] == [24, 8]
    assert [m for g in groups for m in g] == members, "every decode in one group, in order"
    spread = _decodes(list(range(1, 65)))
    groups = split_decodes(spread)
    assert 2 <= len(groups) <= 4 and [m for g in groups for m in g] == spread
    padded = sum(bucket(len(g), 4) * bucket(len(g[-1][2].blocks), 4) for g in groups)
    assert padded + GROUP_OVERHEAD * (len(groups) - 1) < bucket(64, 4) * bucket(64, 4)
