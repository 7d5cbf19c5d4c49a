"""Stopping at end of text (eos, as HF's eos_token_id): plain, sampled and forked requests."""

import random

import pytest
from conftest import baseline, check_invariants, run_engine
from test_fork import samples_as_separate_requests

from ext import ServingEngine
from harness.contiguous import ContiguousEngine
from harness.metrics import metrics
from sequence import Request, RequestStatus, SamplingParams, SequenceStatus


def cut_at(tokens, eos):
    """What a sequence that stops at eos gives back: its tokens up to and including the first eos."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def workload(seed=3, n=8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(2, 20))] for _ in range(n)]
    return prompts, [rng.randint(8, 30) for _ in prompts]


def common_token(outputs):
    """A token that ends some outputs early and is absent from others, so both kinds are tested."""
    counts = {}
    for out in outputs:
        for t in set(out[:-1]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: (0 < counts[t] < len(outputs), counts[t]))


@pytest.mark.parametrize("num_blocks", [400, 14])  # a roomy pool, and one that preempts
def test_plain_requests_stop_at_eos_and_give_every_block_back(model, num_blocks):
    prompts, news = workload()
    full = baseline(model, prompts, news)
    eos = common_token(full)
    want = [cut_at(out, eos) for out in full]
    assert any(len(w) < len(f) for w, f in zip(want, full)) and any(w == f for w, f in zip(want, full))
    for engine in (
        ServingEngine(model, num_blocks=num_blocks, block_size=4, token_budget=16, max_batch=6),
        ContiguousEngine(model, max_batch=6),
    ):
        requests = [Request(p, n, SamplingParams(eos=eos)) for p, n in zip(prompts, news)]
        assert run_engine(engine, requests, check=isinstance(engine, ServingEngine)) == want
        assert all(r.status is RequestStatus.DONE for r in requests) and len(engine.meter.done) == len(requests)
        assert metrics(engine.meter, 1.0, float("inf"), None)["output_tokens"] == sum(map(len, want))
        if isinstance(engine, ServingEngine):
            assert engine.allocator.num_free() == num_blocks and not engine.running and not engine.waiting
            assert num_blocks == 400 or engine.meter.num_preemptions > 0


def test_samples_stop_one_by_one_and_free_their_blocks_at_once(model):
    prompt, new, n, seed = [5, 17, 42, 8, 99, 3, 7], 40, 4, 70
    free = samples_as_separate_requests(model, prompt, new, n, seed, temperature=1.5)
    eos = common_token(free)
    want = [cut_at(out, eos) for out in free]
    assert len({len(w) for w in want}) > 1, "the samples should stop at different steps"
    engine = ServingEngine(model, num_blocks=60, block_size=4, token_budget=64, max_batch=8)
    r = Request(prompt, new, SamplingParams(temperature=1.5, seed=seed, n=n, eos=eos))
    engine.add(r)
    while engine.running or engine.waiting:
        engine.step()
        check_invariants(engine)
        for s in r.sequences:  # a stopped sample holds nothing while its siblings go on
            if s.status is SequenceStatus.DONE:
                assert s.block_table == [] and s.row is None and s.generated == cut_at(s.generated, eos)
    assert [s.generated for s in r.sequences] == want and r.status is RequestStatus.DONE
    assert engine.allocator.num_free() == 60 and all(c == 0 for c in engine.allocator.ref_count)


def test_forks_and_separate_requests_stop_alike_under_memory_pressure(model):
    prompts, news = workload(seed=8, n=5)
    requests = [
        Request(p, m, SamplingParams(temperature=1.2, top_k=20, seed=10 * i, n=3))
        for i, (p, m) in enumerate(zip(prompts, news))
    ]
    free = [
        samples_as_separate_requests(model, p, m, 3, 10 * i, 1.2, 20) for i, (p, m) in enumerate(zip(prompts, news))
    ]
    eos = common_token([out for outs in free for out in outs])
    for r in requests:
        r.params.eos = eos
    engine = ServingEngine(model, num_blocks=16, block_size=4, token_budget=16, max_batch=12)
    run_engine(engine, requests, check=True)
    assert [[s.generated for s in r.sequences] for r in requests] == [[cut_at(o, eos) for o in outs] for outs in free]
    assert engine.meter.num_preemptions > 0 and engine.allocator.num_free() == 16
