"""What the benchmarks claim about their own alternatives: the two-level top-k of bench/sampling.py is exact."""

import pytest
import torch

from bench.sampling import two_level_topk


@pytest.mark.parametrize("vocab", [50304, 50257, 3300, 100])
@pytest.mark.parametrize("k", [1, 200])
def test_two_level_topk_selects_exactly_what_torch_topk_does(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    for logits in [torch.randn(8, vocab, generator=g) * 3, torch.randint(0, 50, (8, vocab), generator=g).float()]:
        if k > vocab:
            continue
        values, ids = two_level_topk(logits, k)
        expected = logits.topk(k).values
        assert torch.equal(values, expected)  # the same k values, sorted, ties included
        assert torch.equal(logits.gather(1, ids), values)  # each id holds its value
        assert all(len(set(row)) == k for row in ids.tolist())  # no column twice
