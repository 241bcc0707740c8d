"""The global block order: a permutation of every block, from the seed and the epoch alone, in constant memory, and
the same blocks at each step for 1 process with batch B as for N processes with batch B / N each."""

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard

from kha_hf.data.order import FeistelPermutation, GlobalBlockOrder


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 65537])
def test_every_block_once(n):
    order = list(GlobalBlockOrder(n, seed=3))
    assert sorted(order) == list(range(n))


def test_the_order_depends_on_seed_and_epoch_only():
    a, b = GlobalBlockOrder(5000, seed=0), GlobalBlockOrder(5000, seed=0)
    assert list(a) == list(b)
    assert list(a) != list(GlobalBlockOrder(5000, seed=1))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == sorted(first)
    a.set_epoch(0)
    assert list(a) == first
    assert first[:50] != list(range(50))  # shuffled, not the identity


def test_the_order_is_spread_like_a_shuffle():
    """Each position is about as likely to hold any block: the mean block of each tenth of the order is near n/2."""
    n = 100_000
    order = np.array(list(GlobalBlockOrder(n, seed=7)))
    means = order.reshape(10, -1).mean(axis=1)
    assert np.all(np.abs(means - n / 2) < 0.02 * n), means


def test_positions_map_in_pieces_as_a_whole():
    """Mapping positions piece by piece (what the sampler does, 65,536 at a time) gives the whole permutation."""
    permutation = FeistelPermutation(200_003, seed=1, epoch=2)
    whole = permutation.apply(np.arange(200_003))
    pieces = np.concatenate([permutation.apply(np.arange(s, min(s + 777, 200_003))) for s in range(0, 200_003, 777)])
    assert np.array_equal(whole, pieces)


def test_one_process_and_two_read_the_same_blocks_each_step():
    """accelerate hands rank r the per-device batches r, r + N, ...: a global step of 2 ranks x 4 blocks covers
    what 1 process with batch 8 reads at that step."""
    n, per_device, ranks = 1003, 4, 2
    one = list(torch.utils.data.BatchSampler(GlobalBlockOrder(n, 0), per_device * ranks, drop_last=True))
    shards = [
        list(
            BatchSamplerShard(
                torch.utils.data.BatchSampler(GlobalBlockOrder(n, 0), per_device, drop_last=True), ranks, r
            )
        )
        for r in range(ranks)
    ]
    for step, batch in enumerate(one):
        assert sorted(batch) == sorted(shards[0][step] + shards[1][step])
