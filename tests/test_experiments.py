"""KV budgets, reservation baselines and online arrivals."""

import heapq
import json
import math
import random

import pytest
import torch
from conftest import baseline, make_requests, tiny_gpt
from test_cli import one_second_steps
from test_model import save_nanogpt_ckpt

import generate
from harness import serving
from harness.contiguous import ContiguousEngine
from harness.metrics import Meter
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams, SequenceStatus


class FakeClock:
    """Time moves only when the engine works (a fixed cost per reading) or sleeps: no real waiting."""

    def __init__(self):
        self.t, self.slept = 0.0, 0.0

    def now(self):
        self.t += 0.001
        return self.t

    def sleep(self, seconds):
        self.t += seconds
        self.slept += seconds


def workload(seed, n=16):
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    return prompts, [rng.randint(1, 20) for _ in prompts]


@pytest.mark.parametrize("reserve", ["max", "pow2", "oracle"])
def test_no_reservation_policy_ever_holds_more_than_the_budget(model, reserve):
    for seed in range(4):
        prompts, news = workload(seed)
        engine = ContiguousEngine(model, max_batch=8, kv_budget=100, reserve=reserve)
        rng = random.Random(seed)
        arrivals = sorted(rng.uniform(0, 0.05) for _ in prompts)
        requests = make_requests(prompts, news)
        peak = 0
        for _ in serving.arrive(engine, Meter(engine, FakeClock()), requests, arrivals):
            held = sum(engine.reservation(s.request) for s in engine.running)
            assert held == engine.reserved <= 100
            assert all(s.num_computed <= engine.reservation(s.request) for s in engine.running)
            peak = max(peak, len(engine.running))
        assert all(r.status is RequestStatus.DONE for r in requests) and engine.reserved == 0
        assert peak == 1 if reserve == "max" else peak > 1  # max reserves the context, 64 of 100: one at a time
        assert [r.generated for r in requests] == baseline(model, prompts, news)


def test_no_request_is_scheduled_before_its_arrival_and_the_idle_engine_sleeps(model):
    prompts, news = workload(5, n=8)
    arrivals = [0.0, 0.0, 0.3, 0.31, 2.0, 2.0, 7.5, 7.6]
    clock = FakeClock()
    engine = PagedEngine(model, num_blocks=80, block_size=4, token_budget=16, max_batch=4)
    scheduled, schedule = {}, engine.schedule

    def record():
        plan = schedule()
        for s, _ in plan:
            scheduled.setdefault(id(s.request), clock.t)
        return plan

    engine.schedule = record
    requests, meter = make_requests(prompts, news), Meter(engine, clock)
    for _ in serving.arrive(engine, meter, requests, arrivals):
        pass
    assert all(scheduled[id(r)] >= at for r, at in zip(requests, arrivals))
    assert [meter.arrival[r] for r in requests] == arrivals  # each arrived when the workload said, not when added
    assert clock.slept > 4.0 and len(meter.steps) < 200  # it slept through the gaps instead of spinning
    assert [r.generated for r in requests] == baseline(model, prompts, news)


# Every request at step 0, no KV budget: what each engine's schedule promises, on a seeded workload

ROWS, BUDGET, BLOCK = 6, 16, 4


def recomputed_greedy(model, prompt, max_new_tokens):
    """Greedy decoding with no cache: the model runs over the whole sequence for every new token."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([tokens]))[0][0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def all_at_once(model):
    """20 prompts of 1-30 tokens, 1-20 new tokens each, and the recomputing oracle's greedy tokens for each."""
    rng = random.Random(11)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    news = [rng.randint(1, 20) for _ in prompts]
    return prompts, news, [recomputed_greedy(model, p, m) for p, m in zip(prompts, news)]


@pytest.fixture(scope="module")
def shared_heads(model):
    """all_at_once's kind of workload, every third prompt after a 9-token head they share (the prefix cache
    hits), and the oracle's tokens."""
    rng = random.Random(13)
    head = [rng.randrange(300) for _ in range(9)]
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 21))] for _ in range(20)]
    prompts = [head + p if i % 3 == 0 else p for i, p in enumerate(prompts)]
    news = [rng.randint(1, 20) for _ in prompts]
    return prompts, news, [recomputed_greedy(model, p, m) for p, m in zip(prompts, news)]


def paged(model, prompts, news, prefix_cache=True):
    """A paged engine whose pool holds every request at once: blocks never hold a request back."""
    num_blocks = sum(blocks_for(len(p) + m - 1, BLOCK) for p, m in zip(prompts, news))
    return PagedEngine(
        model, num_blocks=num_blocks, block_size=BLOCK, token_budget=BUDGET, max_batch=ROWS, prefix_cache=prefix_cache
    )


def serve_all(engine, prompts, news, step_check=None):
    """Every request added at once, greedy, and served -> the requests, the Meter and each step's plan sizes."""
    requests, meter, sizes = make_requests(prompts, news), Meter(engine), []
    schedule = engine.schedule

    def recorded():
        before = [s for s in engine.running if s.status is SequenceStatus.DECODING]
        plan = schedule()
        sizes.append(sum(n for _, n in plan))
        if step_check:
            step_check(engine, before, plan, len(sizes))
        return plan

    engine.schedule = recorded
    engine.run(requests)
    for r, m in zip(requests, news):  # each request generates exactly its max_new_tokens (no eos is set)
        assert r.status is RequestStatus.DONE and len(r.generated) == m
    return requests, meter, sizes


@pytest.mark.parametrize("design", ["contiguous", "paged", "paged_prefix"])
def test_every_engine_gives_the_recomputing_oracles_greedy_tokens_and_exactly_max_new_tokens(
    model, shared_heads, design
):
    """float64: the contiguous baseline and the paged engine, with and without the prefix cache (which serves the
    shared heads), all batching differently, give for every request the tokens of a model that recomputes the
    whole sequence each step."""
    prompts, news, oracle = shared_heads
    if design == "contiguous":
        engine = ContiguousEngine(model, max_batch=ROWS)
    else:
        engine = paged(model, prompts, news, prefix_cache=design == "paged_prefix")
    requests, meter, _ = serve_all(engine, prompts, news)
    for i, (r, want) in enumerate(zip(requests, oracle)):
        assert r.generated == want, f"request {i} (prompt of {len(prompts[i])}) parts from the oracle"
    assert meter.num_preemptions == 0
    assert (meter.cached_tokens > 0) == (design == "paged_prefix")  # the cache served the shared head


def fifo_makespan(news, rows):
    """Steps to serve requests of news[i] new tokens, in order, on `rows` rows, when the head of the queue takes
    the first row free and holds it for exactly its new tokens' steps (its prefill step draws the first)."""
    free = [0] * rows  # the step from which each row is free
    for m in news:
        heapq.heappush(free, heapq.heappop(free) + m)
    return max(free)


def test_the_contiguous_baseline_takes_exactly_the_steps_of_fifo_admission_on_its_rows(model, all_at_once):
    """With no KV budget the baseline admits the head of the queue whenever a row is free, prefills it whole in
    the step that admits it, and decodes every running sequence every step: each request holds a row for exactly
    its max_new_tokens steps, so the run takes the makespan of first-come list scheduling, no step more or less,
    and every step plans every running sequence's uncomputed tokens."""
    prompts, news, _ = all_at_once

    def every_sequence_runs(engine, decoding, plan, step):
        assert len(engine.running) == min(ROWS, len(engine.running) + len(engine.waiting)), f"step {step}: a row idles"
        assert sorted(n for _, n in plan) == sorted(s.num_uncomputed() for s in engine.running), f"step {step}"

    _, meter, _ = serve_all(ContiguousEngine(model, max_batch=ROWS), prompts, news, every_sequence_runs)
    assert len(meter.steps) == fifo_makespan(news, ROWS)


def fills_the_budget_unless_nothing_more_can_run(engine, decoding, plan, step):
    """The paged schedule's promise for one step: every decoding sequence's next token first; then prefill chunks
    in admission order, only the last cut short by the budget; and budget left over only when nothing more could
    run: every admitted prompt planned whole, and none waiting or every row taken (the pool holds every request
    and no prompt shares a block, so neither blocks nor a prefix in flight hold the head of the queue back)."""
    planned = {s: n for s, n in plan}
    assert all(planned.get(s) == 1 for s in decoding), f"step {step}: a decoding sequence was left out"
    prefilling = [s for s in engine.running if s.status is SequenceStatus.PREFILLING]  # in admission order
    cut = [i for i, s in enumerate(prefilling) if planned.get(s, 0) < s.num_uncomputed()]
    left = engine.token_budget - sum(planned.values())
    if cut:  # the first prompt not planned whole took the budget's last tokens; the ones after it wait
        assert left == 0 and not any(planned.get(s) for s in prefilling[cut[0] + 1 :]), f"step {step}: {plan}"
    if left:
        assert not engine.waiting or len(engine.running) == engine.max_batch, f"step {step}: {left} tokens unused"


def test_paged_steps_fill_the_budget_unless_nothing_more_can_run_and_stay_within_their_bounds(model, all_at_once):
    """Every step keeps the schedule's promise (fills_the_budget_unless_nothing_more_can_run), so the step count
    lies within bounds that follow from the workload alone. W tokens go through the forward: every prompt
    token and every new token but the last (none is computed twice: nothing is preempted or cached here).
    Lower: a step computes at most BUDGET tokens, draws at most one token a sequence and one a row, so
    steps >= max(W / BUDGET, max new tokens, total new tokens / ROWS). Upper: a step either fills the budget
    (at most W // BUDGET of those) or plans every running sequence's tokens whole, so every running sequence
    draws a token in it; then either every row runs (at most total new tokens // ROWS such steps) or no request
    waits, which happens only after the last admission, while the sequences then running draw a token each step
    (at most max new tokens steps). No prompt shares a full block, so the prefix cache finds nothing and the run
    with it steps exactly as the run without it."""
    prompts, news, _ = all_at_once
    runs = []
    for prefix_cache in (True, False):
        engine = paged(model, prompts, news, prefix_cache)
        _, meter, sizes = serve_all(engine, prompts, news, fills_the_budget_unless_nothing_more_can_run)
        assert meter.num_preemptions == meter.cached_tokens == meter.recomputed_tokens == 0
        runs.append(sizes)
    work = sum(len(p) + m - 1 for p, m in zip(prompts, news))
    assert sum(runs[0]) == work
    lower = max(math.ceil(work / BUDGET), max(news), math.ceil(sum(news) / ROWS))
    upper = work // BUDGET + sum(news) // ROWS + max(news)
    assert lower <= len(runs[0]) <= upper, (lower, len(runs[0]), upper)
    assert runs[0] == runs[1], "the prefix cache changed the schedule of prompts that share no block"


def test_the_prefix_cache_computes_a_shared_prefix_once(model):
    """8 prompts that share their first three blocks: with the prefix cache, every request after the first finds
    all three cached (one whose next prefix block a running sequence is computing waits for it rather than
    computing it too), so exactly 7 x 12 fewer prompt tokens go through the forward; the tokens stay the oracle's."""
    rng = random.Random(12)
    shared = [rng.randrange(300) for _ in range(3 * BLOCK)]
    prompts = [shared + [i] + [rng.randrange(300) for _ in range(rng.randint(0, 9))] for i in range(8)]
    news = [rng.randint(1, 12) for _ in prompts]
    oracle = [recomputed_greedy(model, p, m) for p, m in zip(prompts, news)]
    prefill = {}
    for prefix_cache in (True, False):
        requests, meter, _ = serve_all(paged(model, prompts, news, prefix_cache), prompts, news)
        assert [r.generated for r in requests] == oracle and meter.num_preemptions == 0
        prefill[prefix_cache] = meter.prefill_tokens
        assert meter.cached_tokens == (len(shared) * (len(prompts) - 1) if prefix_cache else 0)
    assert prefill[False] == sum(map(len, prompts))
    assert prefill[True] == prefill[False] - len(shared) * (len(prompts) - 1)


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "ckpt.pt"
    save_nanogpt_ckpt(tiny_gpt(dtype=torch.float64), path)
    return str(path)


def test_compare_under_a_budget_runs_every_design_and_paged_still_matches_with_preemptions(
    ckpt64, tmp_path, monkeypatch
):
    one_second_steps(monkeypatch)
    out = tmp_path / "b.json"
    generate.main(
        [
            "--ckpt",
            ckpt64,
            "--dtype",
            "float64",
            "--compare",
            "--kv-budget",
            "128",
            "--block-size",
            "4",
            "--num-requests",
            "24",
            "--prompt-len",
            "4:30",
            "--new-tokens",
            "10:30",
            "--temperature",
            "0.9",
            "--top-k",
            "40",
            "--json",
            str(out),
        ]
    )
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["contiguous_max", "contiguous_pow2", "contiguous_oracle", "paged", "paged_prefix"]
    assert all(runs[k]["same_output_pct"] == 100 for k in list(runs)[1:])
    assert runs["paged"]["preemptions"] > 0 and runs["paged"]["num_blocks"] == 32
    for m in runs.values():
        assert m["kv_budget_slots"] == 128 and m["kv_slots_allocated_peak"] <= 128 and m["request_rate"] == "inf"
        # every request arrives at the start and makes 10 to 30 tokens, and a step takes a second: none outlasts
        # the run, and its latency per token lies between its latency over 30 and over 10
        assert m["wall_s"] == m["steps"] and m["output_tok_s"] == m["output_tokens"] / m["steps"]
        assert m["latency_ms_p50"] <= m["latency_ms_p90"] <= m["latency_ms_p99"] <= 1000 * m["steps"]
        assert m["latency_ms_mean"] / 30 <= m["normalized_latency_ms"] <= m["latency_ms_mean"] / 10
        assert 1000 <= m["ttft_ms_mean"] < m["latency_ms_mean"]  # a first token takes a step, and others follow
    assert len({m["output_tokens"] for m in runs.values()}) == 1
    peaks = [runs[k]["running_peak"] for k in runs]
    assert peaks[0] == 2 and peaks[0] <= peaks[1] <= peaks[2] <= peaks[3]  # max reserves 64 of 128: two at a time


def test_sweep_writes_one_point_per_rate_and_a_plot(ckpt64, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    generate.main(
        [
            "--ckpt",
            ckpt64,
            "--dtype",
            "float64",  # the designs batch differently: only in float64 is their equality exact, not luck
            "--compare",
            "--kv-budget",
            "256",
            "--num-requests",
            "10",
            "--prompt-len",
            "4:20",
            "--new-tokens",
            "4:12",
            "--sweep-rates",
            "200,400",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    sweep = json.loads(out.read_text())["sweep"]
    assert [p["request_rate"] for p in sweep] == [200.0, 400.0] and png.stat().st_size > 10_000
    assert all(
        set(p["runs"]) == {"contiguous_max", "contiguous_pow2", "contiguous_oracle", "paged", "paged_prefix"}
        for p in sweep
    )
    # Poisson arrivals: every design still gives the first's tokens, request by request
    assert all(m["same_output_pct"] == 100 for p in sweep for name, m in p["runs"].items() if name != "contiguous_max")


def test_a_request_whose_samples_together_exceed_the_kv_budget_is_refused_in_one_line(model):
    """The contiguous baseline reserves for every sequence a request will run: a request that fits the budget
    alone but not with its forks is refused at add(), not left waiting until the engine stalls."""
    engine = ContiguousEngine(model, max_batch=8, kv_budget=64, reserve="max")  # max: the 64-token context
    engine.add(Request([1, 2, 3], 4))
    with pytest.raises(ValueError, match="reserves 64 slots for each of 2 sequences under --reserve max, but the KV"):
        engine.add(Request([1, 2, 3], 4, SamplingParams(temperature=1.0, n=2)))
