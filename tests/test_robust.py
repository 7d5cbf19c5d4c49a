"""Never stuck, never wrong: preemption, refusals, randomized invariants and a soak."""

import random
import re

import pytest
from conftest import baseline, make_requests, run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext import ServingEngine
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    n = draw(st.integers(1, 8))
    prefix = draw(st.lists(st.integers(0, 299), min_size=0, max_size=12))
    prompts, news = [], []
    for _ in range(n):
        shared = prefix[: draw(st.integers(0, len(prefix)))]
        prompts.append(shared + draw(st.lists(st.integers(0, 299), min_size=1, max_size=14)))
        news.append(draw(st.integers(1, 12)))
    arrivals = draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    fits_one = max(-(-(len(p) + m - 1) // block_size) for p, m in zip(prompts, news))
    num_blocks = fits_one + draw(st.integers(0, 12))  # down to the minimum that fits the largest request
    return dict(
        block_size=block_size,
        prompts=prompts,
        news=news,
        arrivals=arrivals,
        num_blocks=num_blocks,
        token_budget=draw(st.integers(1, 40)),
        max_batch=draw(st.integers(1, 6)),
        prefix_cache=draw(st.booleans()),
        temperature=draw(st.sampled_from([0.0, 0.9])),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(w=workloads())
def test_random_workloads_keep_invariants_and_match_the_baseline(model, w):
    engine = run_random_workload(model, w)
    assert engine.allocator.num_free() == w["num_blocks"] and not engine.running and not engine.waiting


def run_random_workload(model, w, engine_class=PagedEngine, **kw):
    """Serve a workloads() draw with the paged engine it names (of engine_class, with kw), checking the invariants
    after every step and the outputs against the contiguous baseline -> the engine."""
    sizes = {name: w[name] for name in ("num_blocks", "block_size", "token_budget", "max_batch", "prefix_cache")}
    engine = engine_class(model, **sizes, **kw)
    got = run_engine(engine, make_requests(w["prompts"], w["news"], w["temperature"], 40), w["arrivals"], check=True)
    assert got == baseline(model, w["prompts"], w["news"], w["temperature"], 40)
    return engine


def test_pool_far_smaller_than_the_workload_preempts_and_still_matches(model):
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(5, 20))] for _ in range(16)]
    news = [rng.randint(20, 40) for _ in prompts]
    want = baseline(model, prompts, news, 0.9, 40)
    for prefix_cache in [True, False]:
        engine = PagedEngine(
            model, num_blocks=15, block_size=4, token_budget=32, max_batch=8, prefix_cache=prefix_cache
        )
        got = run_engine(engine, make_requests(prompts, news, 0.9, 40), check=True)
        assert got == want and engine.meter.num_preemptions >= 10
        assert engine.allocator.num_free() == 15
        # no two prompts share a block, so every hit is a preempted request readmitted onto its own cached blocks
        assert (engine.meter.cached_tokens > 0) == prefix_cache and engine.meter.admitted_tokens > sum(
            map(len, prompts)
        )


def test_soak_5000_short_requests_through_a_tiny_pool_leak_nothing(model):
    rng = random.Random(5)
    engine = PagedEngine(model, num_blocks=12, block_size=2, token_budget=24, max_batch=12)
    requests = [
        Request([rng.randrange(300) for _ in range(rng.randint(1, 4))], rng.randint(1, 3), SamplingParams(seed=i))
        for i in range(5000)
    ]
    run_engine(engine, requests)
    assert all(r.status is RequestStatus.DONE and len(r.generated) == r.max_new_tokens for r in requests)
    assert len(engine.meter.done) == 5000 and engine.allocator.num_free() == 12
    assert sum(engine.allocator.ref_count) == 0


@pytest.mark.parametrize(
    "request_args, message",
    [
        (([], 5), "empty prompt"),
        (([300], 5), "an id outside the model's 0..299: [300]"),
        (([-1], 5), "an id outside the model's 0..299: [-1]"),
        (([5, 299999], 5), "an id outside the model's 0..299: [5, 299999]"),
        (([1] * 60, 6), "60 tokens + max_new_tokens 6 = 66 exceeds the model's context of 64"),
        (([1] * 10, 0), "max_new_tokens is 0"),
        (([1] * 10, 30), "needs 10 blocks of 4, but the pool has only 8"),
        (([1], 5, dict(temperature=-1.0)), "temperature -1.0 must be a finite number >= 0"),
        (([1], 5, dict(temperature=float("nan"))), "temperature nan must be a finite number >= 0"),
        (([1], 5, dict(temperature=1.0, top_k=0)), "top_k 0 >= 1"),
        (([1], 5, dict(temperature=1.0, top_p=0)), "top_p 0 must be in [1e-38, 1]"),
        (([1], 5, dict(temperature=1.0, top_p=1e-50)), "top_p 1e-50 must be in [1e-38, 1]"),  # 0 in float32
        (([1], 5, dict(temperature=1.0, top_p=1.5)), "top_p 1.5 must be in [1e-38, 1]"),
        (([1], 5, dict(temperature=1.0, top_p=float("nan"))), "top_p nan must be in [1e-38, 1]"),
        (([1], 5, dict(temperature=1.0, min_p=-0.1)), "min_p -0.1 in [0, 1]"),
        (([1], 5, dict(temperature=1.0, min_p=2)), "min_p 2 in [0, 1]"),
        # the core runs one sequence a request: samples and beams are the forks extension's
        (
            ([1], 5, dict(temperature=0.8, n=2)),
            "n 2, num_beams 1, logprobs None, prompt_logprobs None: this engine lacks",
        ),
        (([1], 5, dict(num_beams=3)), "n 1, num_beams 3, logprobs None, prompt_logprobs None: this engine lacks"),
        (([1], 5, dict(logprobs=2)), "n 1, num_beams 1, logprobs 2, prompt_logprobs None: this engine lacks"),
    ],
)
def test_requests_that_can_never_run_are_refused_and_others_go_on(model, request_args, message):
    engine = PagedEngine(model, num_blocks=8, block_size=4)
    fine = Request([1, 2, 3], 4)
    engine.add(fine)
    with pytest.raises(ValueError, match=re.escape(message)):
        prompt, max_new_tokens, *settings = request_args
        engine.add(Request(prompt, max_new_tokens, SamplingParams(**(settings or [{}])[0])))
    run_engine(engine, [])
    assert fine.status is RequestStatus.DONE and len(fine.generated) == 4 and engine.allocator.num_free() == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), "block_size 0"),
        (dict(token_budget=0), "token_budget 0"),
        (dict(num_blocks=0), "num_blocks 0"),
        (dict(max_batch=0), "max_batch 0 must be >= 1"),
    ],
)
def test_bad_engine_arguments_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedEngine(model, **{"num_blocks": 8, **kwargs})


def test_context_plus_one_is_allowed_because_the_last_token_is_never_fed_back(model):
    prompt = list(range(1, 61))  # 60 + 5 = 65 tokens in a context of 64: positions 0..63 are enough
    want = baseline(model, [prompt], [5])
    engine = PagedEngine(model, num_blocks=16, block_size=4)
    assert run_engine(engine, make_requests([prompt], [5]), check=True) == want and len(want[0]) == 5
    assert engine.allocator.num_free() == 16


def test_a_request_is_refused_when_added_twice_or_after_it_finished(model):
    engine = PagedEngine(model, num_blocks=8, block_size=4)
    r = Request([1, 2, 3], 2)
    engine.add(r)
    with pytest.raises(ValueError, match="added before .it is waiting.; a request runs once"):
        engine.add(r)
    run_engine(engine, [])
    with pytest.raises(ValueError, match="added before .it is done."):
        engine.add(r)
    assert len(r.generated) == 2 and r.status is RequestStatus.DONE


def test_preemption_takes_the_newest_so_the_oldest_always_progresses(model):
    """Under a pool that preempts, every victim is the newest of the running sequences, counted by when each
    (re)started: the oldest is let go last (vLLM's order; docs/design.md)."""
    from harness.observer import Observer

    class StartOrder(Observer):
        def __init__(self, engine):
            self.engine, self.order, self.victims, self.admissions = engine, {}, 0, 0

        def admitted(self, group):  # a readmitted sequence starts again, at the tail
            for s in group:
                self.order[s] = self.admissions
                self.admissions += 1

        def preempted(self, victim):  # the victim has just left engine.running
            self.victims += 1
            newest = max(self.engine.running + [victim], key=self.order.get)
            assert newest is victim, f"started {self.order[victim]} was preempted before {self.order[newest]}"

    prompts, news = [[i + 1] * (5 + 3 * i) for i in range(8)], [20] * 8
    engine = PagedEngine(model, num_blocks=20, block_size=4, token_budget=32, max_batch=8)
    observer = StartOrder(engine)
    engine.observers.append(observer)
    assert run_engine(engine, make_requests(prompts, news), check=True) == baseline(model, prompts, news)
    assert observer.victims > 0


def test_a_step_that_plans_nothing_raises_instead_of_spinning(model, monkeypatch):
    engine = PagedEngine(model, num_blocks=8, block_size=4)
    engine.add(Request([1, 2, 3], 4))
    monkeypatch.setattr(engine, "schedule", list)  # a plan of nothing
    with pytest.raises(RuntimeError, match="no progress: 1 waiting, 0 running"):
        engine.step()


def test_admission_leaves_the_watermark_and_each_forks_copy_free(model):
    """With others running, a new sequence is admitted only if its blocks, a copy of its partly filled last
    block for each fork after the first, and the watermark (1% of the pool) are free; alone, it may take all."""
    engine = ServingEngine(model, num_blocks=200, block_size=4)  # a watermark of 2 blocks
    engine.add(Request([1] * 8, 4))
    engine.step()  # it runs
    engine.allocator.allocate(engine.allocator.num_free() - 10)  # 10 blocks left free

    def admits(num_tokens, n=1):
        return engine.can_admit(Request([1] * num_tokens, 1, SamplingParams(temperature=1.0, n=n)).sequences[0], [])

    assert admits(32) and not admits(36)  # 8 blocks + 2 fit in 10; 9 + 2 do not
    assert admits(30) and not admits(30, n=3)  # 8 blocks, and 2 copies of the last, partly filled
    assert admits(32, n=3)  # a full last block is never written: no copies
    engine.running.clear()
    assert admits(40)  # alone: all 10
