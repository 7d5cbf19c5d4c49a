"""The sampler: each token drawn with its softmax probability among a row's own top_k, from a hash of (seed,
position), the same alone and in a batch; and each request's own settings, checked against the model's
logits recomputed in full."""

import random

import pytest
import torch
from conftest import baseline, make_requests, run_engine

from ext import ServingEngine
from harness.contiguous import ContiguousEngine
from sampling import sample, uniform
from sequence import Request, SamplingParams


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.8, 20)])
def test_seeded_sample_is_the_same_alone_and_in_a_batch(model, temperature, top_k):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    news = [12, 20, 5, 16]
    together = run_engine(ContiguousEngine(model, max_batch=4), make_requests(prompts, news, temperature, top_k))
    for i in range(len(prompts)):
        alone = run_engine(ContiguousEngine(model, max_batch=1), [make_requests(prompts, news, temperature, top_k)[i]])
        assert together[i] == alone[0]
    assert together != baseline(model, prompts, news)  # sampling really sampled: not the greedy output


def rows(temperature, top_k, seed, top_p=1.0, min_p=0.0):
    """sample()'s settings (R, 5) from each setting's (R,) values, or one value for every row."""
    columns = torch.broadcast_tensors(
        *(torch.atleast_1d(torch.as_tensor(x, dtype=torch.float64)) for x in (temperature, top_k, top_p, min_p, seed))
    )
    return torch.stack(columns, 1)


def test_sampler_draws_each_token_with_its_softmax_probability_and_top_k_cuts_the_tail():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(n, 5).contiguous()
    position, seed, ones = torch.arange(n), torch.full((n,), 7), torch.ones(n)
    for temperature, top_k in [(1.0, 0), (0.5, 0), (1.0, 3)]:
        want = (logits[0, : top_k or 5] / temperature).softmax(-1)
        got = sample(logits, rows(ones * temperature, top_k, seed), position, top_k, top_k == 0)
        freq = torch.bincount(got, minlength=5).double() / n
        assert torch.all(freq[len(want) :] == 0) and torch.allclose(freq[: len(want)], want.double(), atol=0.012), (
            freq,
            want,
        )
    alone = sample(logits, rows(ones, 0, seed), position)
    assert torch.equal(alone, sample(logits, rows(ones, 0, seed), position))  # a pure function
    assert not torch.equal(alone, sample(logits, rows(ones, 0, seed + 1), position))
    # rows that keep every id, rows that cut, and greedy rows in one batch: each draws as it does alone
    mixed_k, mixed_t = torch.tensor([0, 3, 0] * (n // 3)), torch.tensor([1.0, 1.0, 0.0] * (n // 3))
    cut = sample(logits, rows(ones, 3, seed), position, 3, False)
    m = len(mixed_k)
    mixed = sample(logits[:m], rows(mixed_t, mixed_k, seed[:m]), position[:m], 3, True)
    assert torch.equal(mixed[0::3], alone[0 : len(mixed_k) : 3]) and torch.equal(mixed[1::3], cut[1 : len(mixed_k) : 3])
    assert torch.all(mixed[2::3] == 0)
    u = uniform(
        torch.arange(1000).repeat_interleave(100), torch.arange(100).repeat(1000)
    )  # 1,000 seeds x 100 positions
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(u.unique()) > 99_000  # seeds and positions both change the draw


def recomputed_samples(model, prompt, max_new_tokens, temperature, top_k, seed, vocab_size):
    """The oracle for one sequence: each next token drawn by sample() alone, from logits recomputed over the whole
    sequence (no cache, no batch), ids from vocab_size on masked, at the drawn token's position with the
    sequence's own temperature, top_k (None, or one of vocab_size or more: every id) and seed."""
    tokens = list(prompt)
    k = top_k if top_k is not None and top_k < vocab_size else 0
    sampled = temperature > 0
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor(tokens)[None])[0][:, -1]  # (1, V)
            logits[:, vocab_size:] = float("-inf")
            token = sample(
                logits,
                rows(temperature, k, seed),
                position=torch.tensor([len(tokens)]),  # the drawn token's own position
                num_best=k if sampled else 0,
                uncut=sampled and not k,
            )
            tokens.append(int(token))
    return tokens[len(prompt) :]


def test_each_requests_own_temperature_top_k_and_seed_draw_what_the_recomputing_oracle_draws(model):
    """Requests of different temperatures, top_ks (small, large, none, past the vocabulary) and seeds in the
    same steps, and n samples seeded seed + i: on both engines (the paged one chunking prompts beside decodes,
    and preempting), every sequence's tokens are the oracle's, which shares nothing with the engines but
    sample(). In float64, where cached and recomputed logits agree to rounding. Engines compared with each other
    would all agree on a setting written wrong in their shared code (a top_k doubled, a seed off by one)."""
    rng = random.Random(21)
    settings = [(0.7, None), (1.0, 3), (1.3, 10), (1.0, 40), (0.0, None), (0.9, 400), (2.0, 1), (0.8, 20)]
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in settings]
    news = [rng.randint(6, 14) for _ in settings]
    vocab_size = 290  # ids 290..299 are never drawn

    def make():
        return [
            Request(p, m, SamplingParams(temperature=t, top_k=k, seed=100 + 7 * i, n=2 if i == 7 else 1))
            for i, (p, m, (t, k)) in enumerate(zip(prompts, news, settings))
        ]

    want = [
        [recomputed_samples(model, p, m, t, k, 100 + 7 * i + j, vocab_size) for j in range(2 if i == 7 else 1)]
        for i, (p, m, (t, k)) in enumerate(zip(prompts, news, settings))
    ]
    assert len({w[0][0] for w in want}) > 4  # the settings draw differently
    for engine in (
        ContiguousEngine(model, max_batch=9, vocab_size=vocab_size),
        ServingEngine(model, num_blocks=18, block_size=4, token_budget=12, max_batch=9, vocab_size=vocab_size),
    ):
        requests = make()
        run_engine(engine, requests, arrivals=[0, 0, 1, 1, 2, 3, 3, 4], check=isinstance(engine, ServingEngine))
        assert [[s.generated for s in r.sequences] for r in requests] == want
    assert engine.meter.num_preemptions > 0
