"""The sampler: each token drawn with its softmax probability among a row's own top_k, from a hash of (seed,
position), the same alone and in a batch; and each request's own settings, checked against the model's
logits recomputed in full."""

import pytest
import torch
from conftest import baseline, make_requests, run_engine

from contiguous import ContiguousEngine
from sampling import sample, uniform


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.8, 20)])
def test_seeded_sample_is_the_same_alone_and_in_a_batch(model, temperature, top_k):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    news = [12, 20, 5, 16]
    together = run_engine(ContiguousEngine(model, max_batch=4), make_requests(prompts, news, temperature, top_k))
    for i in range(len(prompts)):
        alone = run_engine(ContiguousEngine(model, max_batch=1), [make_requests(prompts, news, temperature, top_k)[i]])
        assert together[i] == alone[0]
    assert together != baseline(model, prompts, news)  # sampling really sampled: not the greedy output


def test_sampler_draws_each_token_with_its_softmax_probability_and_top_k_cuts_the_tail():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(n, 5).contiguous()
    position, seed, ones = torch.arange(n), torch.full((n,), 7), torch.ones(n)
    for temperature, top_k in [(1.0, 0), (0.5, 0), (1.0, 3)]:
        want = (logits[0, : top_k or 5] / temperature).softmax(-1)
        got = sample(logits, ones * temperature, torch.full((n,), top_k), seed, position, top_k, top_k == 0)
        freq = torch.bincount(got, minlength=5).double() / n
        assert torch.all(freq[len(want) :] == 0) and torch.allclose(freq[: len(want)], want.double(), atol=0.012), (
            freq,
            want,
        )
    alone = sample(logits, ones, torch.zeros(n, dtype=torch.long), seed, position)
    assert torch.equal(alone, sample(logits, ones, torch.zeros(n, dtype=torch.long), seed, position))  # a pure function
    assert not torch.equal(alone, sample(logits, ones, torch.zeros(n, dtype=torch.long), seed + 1, position))
    # rows that keep every id, rows that cut, and greedy rows in one batch: each draws as it does alone
    mixed_k, mixed_t = torch.tensor([0, 3, 0] * (n // 3)), torch.tensor([1.0, 1.0, 0.0] * (n // 3))
    cut = sample(logits, ones, torch.full((n,), 3), seed, position, 3, False)
    mixed = sample(logits[: len(mixed_k)], mixed_t, mixed_k, seed[: len(mixed_k)], position[: len(mixed_k)], 3, True)
    assert torch.equal(mixed[0::3], alone[0 : len(mixed_k) : 3]) and torch.equal(mixed[1::3], cut[1 : len(mixed_k) : 3])
    assert torch.all(mixed[2::3] == 0)
    u = uniform(
        torch.arange(1000).repeat_interleave(100), torch.arange(100).repeat(1000)
    )  # 1,000 seeds x 100 positions
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(u.unique()) > 99_000  # seeds and positions both change the draw
