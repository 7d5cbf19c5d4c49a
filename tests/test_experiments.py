"""KV budgets, reservation baselines and online arrivals."""

import hashlib
import json
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
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams


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


def test_rate_inf_and_no_budget_give_exactly_todays_outputs_and_step_counts(model):
    """Pinned from the engines before arrivals and budgets existed (2026-11-22)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    news = [rng.randint(1, 20) for _ in prompts]
    for engine, steps in [
        (ContiguousEngine(model, max_batch=6), 38),
        (PagedEngine(model, num_blocks=60, block_size=4, token_budget=16, max_batch=6), 45),
        (PagedEngine(model, num_blocks=60, block_size=4, token_budget=16, max_batch=6, prefix_cache=False), 45),
    ]:
        requests, meter = make_requests(prompts, news), Meter(engine)
        engine.run(requests)
        digest = hashlib.md5(str([r.generated for r in requests]).encode()).hexdigest()[:10]
        assert (len(meter.steps), digest) == (steps, "c9fcc87962")


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
        assert m["kv_budget_slots"] == 128 and m["kv_slots_allocated_peak"] <= 128 and m["request_rate"] == float("inf")
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
