"""Fork with copy-on-write: n samples of one prompt, and beam search, on shared blocks."""

import itertools
import random

import pytest
import torch
from conftest import baseline, check_invariants, run_engine, tiny_gpt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext import ServingEngine
from harness.contiguous import ContiguousEngine
from sequence import Request, RequestStatus, SamplingParams, SequenceStatus


def samples_as_separate_requests(model, prompt, new, n, seed, temperature=0.9, top_k=None):
    """The oracle for n samples: n plain requests on the contiguous baseline, seeded seed, seed + 1, ..."""
    requests = [
        Request(prompt, new, SamplingParams(temperature=temperature, top_k=top_k, seed=seed + i)) for i in range(n)
    ]
    return run_engine(ContiguousEngine(model, max_batch=n), requests)


def outputs(r):
    return [s.generated for s in r.sequences]


def leaks_nothing(engine):
    alloc = engine.allocator
    assert not engine.running and not engine.waiting
    assert alloc.num_free() == alloc.num_blocks and all(c == 0 for c in alloc.ref_count)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("top_k", [None, 20])
def test_n_samples_fork_once_and_equal_separate_requests_with_the_same_seeds(model, prefix_cache, top_k):
    prompt = [random.Random(1).randrange(300) for _ in range(23)]
    for n in (1, 2, 4, 6):
        engine = ServingEngine(model, num_blocks=60, block_size=4, token_budget=64, prefix_cache=prefix_cache)
        r = Request(prompt, 9, SamplingParams(temperature=0.9, top_k=top_k, seed=70, n=n))
        run_engine(engine, [r], check=True)
        assert outputs(r) == samples_as_separate_requests(model, prompt, 9, n, 70, 0.9, top_k)
        assert r.generated == outputs(r)[0] and r.status is RequestStatus.DONE and list(engine.meter.done) == [r]
        assert engine.meter.prefill_tokens == len(prompt), f"n={n}: the prompt was prefilled more than once"
        leaks_nothing(engine)


def test_copy_on_write_copies_exactly_the_shared_partial_block(model):
    engine = ServingEngine(model, num_blocks=20, block_size=4, token_budget=64)
    r = Request(
        list(range(1, 11)), 5, SamplingParams(temperature=0.9, seed=3, n=3)
    )  # 10 tokens: blocks 0 and 1 full, block 2 holds 2
    engine.add(r)
    engine.step()  # prefill, then fork: three sequences share all three blocks
    a, b, c = r.sequences
    assert a.block_table == b.block_table == c.block_table and engine.allocator.num_free() == 17
    assert [engine.allocator.ref_count[x] for x in a.block_table] == [3, 3, 3]
    shared_k = engine.kv_pool[0][:, a.block_table[2]].clone()
    engine.step()  # each writes position 10 into block 2: two copy it first, the last keeps it
    tails = [s.block_table[2] for s in (a, b, c)]
    assert len(set(tails)) == 3 and engine.allocator.num_free() == 15, "not exactly one copy per extra holder"
    assert [engine.allocator.ref_count[x] for x in a.block_table[:2]] == [3, 3], "a full block was copied"
    for tail in tails:  # each copy holds the shared two tokens; each sequence then wrote its own third
        torch.testing.assert_close(engine.kv_pool[0][:, tail, :2], shared_k[:, :2], rtol=0, atol=0)
    run_engine(engine, [])
    leaks_nothing(engine)


def test_n_samples_under_memory_pressure_preempt_forks_and_still_match(model):
    rng = random.Random(4)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(5, 20))] for _ in range(4)]
    requests = [
        Request(p, 12, SamplingParams(temperature=0.9, top_k=10, seed=100 * i, n=3)) for i, p in enumerate(prompts)
    ]
    engine = ServingEngine(model, num_blocks=14, block_size=4, token_budget=16, max_batch=12)
    run_engine(engine, requests, check=True)
    assert engine.meter.num_preemptions > 0
    for r, p, i in zip(requests, prompts, itertools.count()):
        assert outputs(r) == samples_as_separate_requests(model, p, 12, 3, 100 * i, 0.9, 10)
    leaks_nothing(engine)


def reference_beam_search(model, prompt, new, k):
    """Beam search by full recomputation, no cache: HF's arithmetic (float32 log-probabilities, summed)."""
    beams = [(torch.tensor(0.0), list(prompt))]
    with torch.no_grad():
        for _ in range(new):
            logits = torch.stack([model(torch.tensor(tokens)[None])[0][0, -1] for _, tokens in beams])
            scores = torch.log_softmax(logits.float(), -1) + torch.stack([s for s, _ in beams])[:, None]
            top = scores.flatten().topk(k)
            V = scores.shape[1]
            beams = [(v, beams[i // V][1] + [i % V]) for v, i in zip(top.values, top.indices.tolist())]
    return [tokens[len(prompt) :] for _, tokens in beams]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_beam_search_equals_the_recomputing_reference_on_both_engines(model, k):
    rng = random.Random(k)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    want = [reference_beam_search(model, p, 7, k) for p in prompts]
    for engine in (
        ContiguousEngine(model, max_batch=12),
        ServingEngine(model, num_blocks=60, block_size=4, max_batch=12),
    ):
        requests = [Request(p, 7, SamplingParams(num_beams=k)) for p in prompts]
        run_engine(engine, requests, check=isinstance(engine, ServingEngine))
        assert [outputs(r) for r in requests] == want
        assert [r.generated for r in requests] == [w[0] for w in want]
    leaks_nothing(engine)


def test_enough_beams_find_the_likeliest_continuation_of_all():
    """With k >= V^(T-1) beams nothing is ever dropped before the last step, so the best beam is the
    exhaustive argmax over all V^T continuations."""
    model = tiny_gpt(seed=2, vocab_size=5)
    prompt, T = [1, 4, 2], 3  # 25 beams > 5 ids: the first step keeps 5, as HF's (its others score -1e9)
    with torch.no_grad():

        def logprob(cont):
            logits = model(torch.tensor(prompt + list(cont))[None])[0][0, len(prompt) - 1 : -1]
            return sum(torch.log_softmax(logits.float(), -1)[t, c] for t, c in enumerate(cont))

        best = max(itertools.product(range(5), repeat=T), key=lambda cont: float(logprob(cont)))
    r = Request(prompt, T, SamplingParams(num_beams=25))
    run_engine(ServingEngine(model, num_blocks=80, block_size=2, max_batch=25, token_budget=64), [r], check=True)
    assert r.generated == list(best)


def test_beam_groups_under_memory_pressure_are_preempted_whole_and_match(model):
    rng = random.Random(9)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 16))] for _ in range(8)]
    want = [reference_beam_search(model, p, 10, 3) for p in prompts]
    for num_blocks, block_size, token_budget in [(21, 4, 16), (39, 2, 12), (28, 3, 9)]:  # 3 x the largest request
        engine = ServingEngine(
            model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget, max_batch=12
        )
        requests = [Request(p, 10, SamplingParams(num_beams=3)) for p in prompts]
        run_engine(engine, requests, check=True)
        assert [outputs(r) for r in requests] == want
        assert engine.meter.num_preemptions > 0
        leaks_nothing(engine)


def test_dying_beams_give_their_blocks_back_and_sharing_saves_blocks(model):
    prompt = list(range(1, 41))  # 40 tokens: 10 full blocks of 4 that every beam shares
    engine = ServingEngine(model, num_blocks=200, block_size=4, token_budget=64, max_batch=8)
    r = Request(prompt, 12, SamplingParams(num_beams=4))
    engine.add(r)
    held, private, live, deaths = [], [], [], 0
    while engine.running or engine.waiting:
        engine.step()
        check_invariants(engine)
        dead = [s for s in live if s.status is SequenceStatus.DEAD]
        assert all(not s.block_table and s.row is None for s in dead), "a dead beam kept its blocks or row"
        deaths += len(dead)
        live = list(engine.running)
        assert len(live) <= 4
        held.append(engine.allocator.num_blocks - engine.allocator.num_free())
        private.append(sum(len(s.block_table) for s in live))
    assert max(held[1:-1]) < 0.5 * max(private[1:-1]), "four beams held nearly four private copies"
    assert deaths > 0
    leaks_nothing(engine)


def test_mixed_steps_of_beams_samples_and_plain_requests_each_equal_their_solo_run(model):
    rng = random.Random(12)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(2, 18))] for _ in range(6)]
    kinds = [
        dict(num_beams=3),
        dict(n=3, temperature=0.9),
        dict(),
        dict(num_beams=2),
        dict(temperature=0.9, top_k=9),
        dict(n=2, temperature=0.9, top_k=9),
    ]

    def make():
        return [Request(p, 8, SamplingParams(seed=50 + i, **kw)) for i, (p, kw) in enumerate(zip(prompts, kinds))]

    solo = []
    for r in make():
        run_engine(ServingEngine(model, num_blocks=40, block_size=4, max_batch=12), [r])
        solo.append(outputs(r))
    for num_blocks in (80, 18):
        engine = ServingEngine(model, num_blocks=num_blocks, block_size=4, token_budget=20, max_batch=12)
        requests = make()
        run_engine(engine, requests, arrivals=[0, 1, 1, 2, 4, 4], check=True)
        assert [outputs(r) for r in requests] == solo
        leaks_nothing(engine)
    assert engine.meter.num_preemptions > 0
    contiguous = make()
    run_engine(ContiguousEngine(model, max_batch=12, kv_budget=800, reserve="oracle"), contiguous)
    assert [outputs(r) for r in contiguous] == solo


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_random_forks_writes_preemptions_and_frees_keep_every_invariant(model, data):
    block_size = data.draw(st.integers(1, 5))
    requests, arrivals = [], []
    for i in range(data.draw(st.integers(1, 5))):
        prompt = data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=12))
        kind = data.draw(st.sampled_from(["plain", "samples", "beams"]))
        width = data.draw(st.integers(1, 3))
        kw = dict(n=width, temperature=0.8) if kind == "samples" else dict(num_beams=width) if kind == "beams" else {}
        requests.append((prompt, data.draw(st.integers(1, 8)), kw, i))
        arrivals.append(data.draw(st.integers(0, 6)))
    worst = max(-(-(len(p) + m - 1) // block_size) * kw.get("num_beams", 1) for p, m, kw, _ in requests)
    num_blocks = worst + data.draw(st.integers(0, 10))
    engine = ServingEngine(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        token_budget=data.draw(st.integers(3, 24)),
        max_batch=6,
        prefix_cache=data.draw(st.booleans()),
    )
    made = [Request(p, m, SamplingParams(seed=i, **kw)) for p, m, kw, i in requests]
    run_engine(engine, made, arrivals, check=True)
    for r, (p, m, kw, i) in zip(made, requests):
        if "num_beams" in kw:
            assert outputs(r) == reference_beam_search(model, p, m, kw["num_beams"])
        elif "n" in kw:
            assert outputs(r) == samples_as_separate_requests(model, p, m, kw["n"], i, 0.8)
        else:
            assert outputs(r) == baseline(model, [p], [m])
    leaks_nothing(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n 0 and num_beams 1 must be at least 1"),
        (dict(num_beams=0), "n 1 and num_beams 0 must be at least 1"),
        (dict(num_beams=2, temperature=0.8), "beam search is greedy"),
        (dict(num_beams=2, top_k=5), "beam search is greedy"),
        (dict(num_beams=2, n=2), "beam search is greedy"),
        (dict(num_beams=2, top_p=0.9), "beam search is greedy: no n, temperature, top_k, top_p or min_p"),
        (dict(num_beams=2, min_p=0.1), "beam search is greedy: no n, temperature, top_k, top_p or min_p"),
        (dict(n=9), "9 sequences of one request exceed the 8 that run at once"),
        (dict(num_beams=4), "needs 12 blocks of 4, but the pool has only 10"),
    ],
)
def test_bad_fork_requests_are_refused_in_one_line(model, kwargs, message):
    engine = ServingEngine(model, num_blocks=10, block_size=4, max_batch=8)
    with pytest.raises(ValueError, match=message) as e:
        engine.add(Request(list(range(1, 9)), 4, SamplingParams(**kwargs)))
    assert "\n" not in str(e.value)


def test_a_beam_group_keeps_its_rows_while_it_runs_fewer_beams_than_its_width():
    """3 beams over 2 ids: the first step picks 2 (as HF's, whose third scores -1e9), the next 3 again. Admission
    counts the group's width, not its live beams, so a request added between the steps waits for a row instead of
    taking the one the group grows back into (a crash, both requests lost)."""
    model = tiny_gpt(vocab_size=2)
    paged = ServingEngine(model, num_blocks=64, block_size=4, max_batch=3, vocab_size=2)
    for engine in [paged, ContiguousEngine(model, max_batch=3, vocab_size=2)]:
        beams, plain = Request([0, 1, 1, 0], 6, SamplingParams(num_beams=3)), Request([1, 0, 1], 6)
        engine.add(beams)
        engine.step()  # the prompt, then the first beam step: 2 live beams
        assert len(beams.sequences) == 2 and not engine.waiting
        engine.add(plain)
        engine.step()
        assert len(beams.sequences) == 3 and list(engine.waiting) == plain.sequences  # it waits for a row
        run_engine(engine, [])
        assert beams.status is plain.status is RequestStatus.DONE
        assert plain.generated == baseline(model, [plain.prompt], [6])[0]
