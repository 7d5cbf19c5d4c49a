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
    alone = sample(logits, rows(ones, 0, seed), position, 0, True)
    assert torch.equal(alone, sample(logits, rows(ones, 0, seed), position, 0, True))  # a pure function
    assert not torch.equal(alone, sample(logits, rows(ones, 0, seed + 1), position, 0, True))
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
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
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


def kept_ids(logits, temperature, top_k, top_p, min_p):
    """The ids sample() may draw for one row (1, V) with these settings, read from the functions it draws
    with: every id for a row that does not cut, else its candidates at or above the least value kept (top-p alone
    cuts every id's value, sorted)."""
    from sampling import cut_value, scale

    V = logits.shape[1]
    best = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).best(V)
    t = torch.tensor([[temperature]], dtype=torch.float32)
    least = torch.tensor([[min_p]], dtype=torch.float64).log()
    if not best and top_p == 1:
        x = scale(logits.float(), t)
        return set(torch.nonzero(x[0] >= least[0, 0]).flatten().tolist())
    values, ids = logits.float().topk(V)  # every candidate: this helper reads the set, not sample()'s speed
    x = scale(values, t)
    least = cut_value(x, torch.tensor([best]), torch.tensor([top_p], dtype=torch.float64), least.float())[0]
    return set(ids[0][x[0] >= least[0, 0]].tolist())


def hf_kept_ids(logits, temperature, top_k, top_p, min_p):
    """The ids Hugging Face's warpers keep, in their order: temperature, top-k, top-p, min-p (float64)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.double()
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return set(torch.nonzero(scores[0] > float("-inf")).flatten().tolist())


def test_top_k_top_p_and_min_p_keep_hugging_faces_ids_on_random_logits_with_ties():
    """On random logits, many of them tied (rounded to a coarse grid), at tiny to huge temperatures and every
    combination of settings: the ids we may draw are the ones Hugging Face's warpers keep. Where top-p's
    boundary falls inside a tie, HF keeps those of the tied ids its unstable sort puts first; we keep all of
    them (as top-k keeps every id tied with the k-th, in HF too): exactly the ids at or above the least logit HF
    keeps."""
    rng = random.Random(5)
    checked = boundary_ties = 0
    for _ in range(300):
        V = rng.choice([7, 50, 300])
        grid = rng.choice([0.25, 0.5, 1.0])
        logits = (torch.randn(1, V, dtype=torch.float64) * rng.choice([0.5, 2, 6]) / grid).round() * grid
        temperature = rng.choice([1e-3, 0.3, 1.0, 2.5, 40.0])
        top_k = rng.choice([None, 1, 3, 20, V + 5])
        top_p = rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6])
        min_p = rng.choice([0.0, 0.05, 0.3, 0.9])
        ours = kept_ids(logits, temperature, top_k, top_p, min_p)
        hf = hf_kept_ids(logits, temperature, top_k, top_p, min_p)
        least = min(logits[0, i] for i in hf)
        assert hf <= ours == {i for i in range(V) if logits[0, i] >= least}, (V, temperature, top_k, top_p, min_p)
        checked += 1
        boundary_ties += ours != hf
    assert checked == 300 and 0 < boundary_ties < checked / 2  # ties at top-p's boundary happen; most sets are HF's


def test_the_draw_is_the_inverse_cdf_of_the_kept_distribution_at_our_uniform():
    """A row with top-k, top-p and min-p draws the kept candidate, in order best first, whose CDF of the kept
    probabilities at its temperature first passes uniform(seed, position); a row without top-k (top_p alone, with
    min_p or not) the same in id order, on peaked logits and on nearly flat ones, where it keeps most of the
    vocabulary."""
    rng = random.Random(8)
    most = 0
    for _ in range(200):
        V = rng.choice([30, 300, 3000])
        logits = torch.randn(1, V, dtype=torch.float64) * rng.choice([0.05, 3])
        temperature, top_k = rng.choice([0.5, 1.0, 1.7]), rng.choice([5, 40, None])
        top_p, min_p = rng.choice([(0.8, 0.02), (0.95, 0.0)])
        seed, position = rng.randrange(1000), rng.randrange(200)
        best = SamplingParams(temperature=1, top_k=top_k, top_p=top_p).best(V)
        settings = rows(temperature, best, seed, top_p, min_p)
        token = int(sample(logits, settings, torch.tensor([position]), best, not best))
        kept = kept_ids(logits, temperature, top_k, top_p, min_p)
        ranked = logits[0].float().topk(V).indices.tolist() if best else range(V)
        order = [i for i in ranked if i in kept]
        p = torch.tensor([float(logits[0, i]) for i in order], dtype=torch.float32)
        cdf = ((p - p.max()) / temperature).softmax(-1).cumsum(-1)
        u = float(uniform(torch.tensor([seed]), torch.tensor([position])))
        column = min(int((cdf <= u * cdf[-1]).sum()), len(order) - 1)
        assert token == order[column]
        most += len(kept) > V / 2
    assert most > 10  # rows that keep most of the vocabulary


def test_rows_spanning_past_exps_range_draw_the_inverse_cdf_computed_without_a_clamp():
    """Peaked rows at a low temperature (a trained model's, at 0.1): their scaled logits span ~400, where float32's
    exp underflows, and sample() clamps an uncut row's at -87 (torch's CPU exp is slow where it underflows). Every
    draw, temperature alone, with min-p and with top-p, is still the inverse CDF of the kept distribution at our
    uniform, computed here in float64 from the unclamped values."""
    torch.manual_seed(3)
    R, V, temperature = 16, 3000, 0.1
    logits = torch.randn(R, V) * 8
    position, seed = torch.arange(R) + 40, torch.arange(R) + 11
    u = uniform(seed, position).double()
    assert ((logits.amax(-1) - logits.amin(-1)) / temperature).min() > 300
    for top_p, min_p in [(1.0, 0.0), (1.0, 1e-30), (0.9, 0.0), (0.999, 0.0)]:
        tokens = sample(logits, rows(temperature, 0, seed, top_p, min_p), position, 0, True)
        for i in range(R):
            kept = sorted(kept_ids(logits[i : i + 1], temperature, None, top_p, min_p))
            x = (logits[i].double() - logits[i].max()) / temperature
            cdf = x[kept].exp().cumsum(0)
            column = min(int((cdf <= u[i] * cdf[-1]).sum()), len(kept) - 1)
            assert int(tokens[i]) == kept[column], (top_p, min_p, i)


def test_an_id_at_minus_infinity_is_never_drawn_not_even_at_the_least_uniform():
    """An uncut row's values are clamped at -87 (so an id at -inf weighs ~1e-38 of the best id): the draw still
    never lands on it. The hash's least output (the 24 bits 0, at seed 2,745,525 and position 5) gives the least
    uniform, 2**-24, not 0, whose target lies past any run of such ids at the row's start; nor at a low
    temperature on an id thousands below the best."""
    from sampling import mix32

    seed, position = torch.tensor([2_745_525]), torch.tensor([5])
    assert int(mix32((mix32(seed) + position) & 0xFFFFFFFF)) >> 8 == 0
    assert float(uniform(seed, position)) == 2**-24
    logits = torch.linspace(0, -5, 64)[None].repeat(2, 1)
    logits[0, :3] = float("-inf")
    logits[1, 0] = -200.0
    for temperature, top_p in [(1.0, 1.0), (0.001, 1.0), (1.0, 0.999)]:
        tokens = sample(logits, rows(temperature, 0, seed.expand(2), top_p), position.expand(2), 0, True)
        assert tokens.tolist() == [3, 1], (temperature, top_p, tokens)  # each row's first id of any weight
    u = uniform(torch.arange(200_000), torch.full((200_000,), 7))
    assert u.min() > 0 and u.max() < 1


@pytest.mark.parametrize("top_p, min_p", [(0.7, 0.0), (1.0, 0.1), (0.9, 0.05)])
def test_top_p_and_min_p_draw_the_same_alone_and_in_a_batch(model, top_p, min_p):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    news = [12, 20, 5, 16]

    def make():
        return [
            Request(p, n, SamplingParams(temperature=1.2, top_k=k, top_p=top_p, min_p=min_p, seed=50 + i))
            for i, (p, n, k) in enumerate(zip(prompts, news, [None, 30, None, 5]))
        ]

    together = run_engine(ServingEngine(model, num_blocks=40, block_size=4, max_batch=4), make())
    for i in range(len(prompts)):
        alone = run_engine(ServingEngine(model, num_blocks=40, block_size=4, max_batch=1), [make()[i]])
        assert together[i] == alone[0]
    assert together != baseline(model, prompts, news)


def test_a_top_k_rows_top_p_reads_every_id_tied_with_its_k_th_alone_as_in_a_batch():
    """Ties with the k-th that run past the candidates (its k best and one more) are kept, and top-p's mass must
    hold them: alone, the row fetches more candidates for them, as it has them in a batch with a larger top_k.
    A review found the fetch asked only whether the cut kept the one more (2026-11-28): alone, this row's top-p
    cut fell among {0, 1}, where in the batch its mass held the ten ids tied at -1. Which of those tied ids a
    draw takes follows torch.topk's order among ties, its own at each k."""
    logits = torch.full((2, 200), -20.0)
    logits[:, 0], logits[:, 1], logits[:, 2:12] = 0.0, -0.5, -1.0
    for position in range(40):
        pos = torch.tensor([position, position])
        batch = sample(logits, rows([1.0, 1.0], [3, 100], [5, 6], [0.6, 1.0]), pos, 100, False)
        alone = sample(logits[:1], rows(1.0, 3, 5, 0.6), pos[:1], 3, False)
        assert logits[0, alone] == logits[0, batch[0]]  # the same value: among tied ids, torch.topk's order


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_draws_on_cuda_what_it_draws_on_the_cpu():
    """Every path of sample() on a CUDA GPU, where top-p alone sorts with torch: greedy, top-k, top-p alone,
    min-p, top-k with top-p, and rows of each in one call, draw the tokens the CPU draws (logits in float64;
    the draw is float32 on both, so the two differ only where a uniform falls within rounding of a CDF's step)."""
    torch.manual_seed(0)
    R, V = 60, 300
    logits = torch.randn(R, V, dtype=torch.float64) * 3
    kinds = [(0.0, 0, 1.0, 0.0), (1.0, 20, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 20, 0.9, 0.0)]
    for chosen in [range(len(kinds))] + [[i] for i in range(len(kinds))]:
        settings = [kinds[chosen[j % len(chosen)]] for j in range(R)]
        best = [k for t, k, _, _ in settings if t > 0]
        temperature, top_k, top_p, min_p = zip(*settings)
        table = rows(temperature, top_k, range(R), top_p, min_p)
        position = torch.arange(R) + 7
        args = (max(best, default=0), 0 in best)
        on_cpu = sample(logits, table, position, *args)
        on_gpu = sample(logits.cuda(), table.cuda(), position.cuda(), *args).cpu()
        assert torch.equal(on_cpu, on_gpu), chosen
