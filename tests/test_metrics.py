"""What a run measures (metrics.py): Meter hears the engine's steps, metrics() turns them into vLLM's
benchmark figures (TTFT, TPOT, latency, percentiles) and the KV slots' use; --compare's agreement."""

import pytest
from conftest import run_engine

from harness.contiguous import ContiguousEngine
from harness.metrics import Meter, agreement, cell, metrics, percentile
from harness.observer import Observer
from scheduler import PagedEngine
from sequence import Request


def test_percentiles_interpolate_between_closest_ranks():
    assert percentile([10.0, 20.0], 90) == 19.0  # not the minimum, as int(0.9 * (n - 1)) gave
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 100.0], 99) == 99.0 and percentile([7.0], 99) == 7.0


def test_waste_counts_only_last_block_tails_and_prompt_blocks_held_ahead_are_reported_apart(model):
    engine = PagedEngine(model, num_blocks=8, block_size=4, token_budget=4)
    run_engine(engine, [Request(list(range(1, 11)), 3)])  # 10 prompt tokens in 3 blocks, 4 per step
    # (allocated, used, ahead): the prompt's 3 blocks are allocated at admission, filled 4 tokens a step
    assert [(s["allocated"], s["used"], s["ahead"]) for s in engine.meter.steps] == [
        (12, 4, 8),
        (12, 8, 4),
        (12, 10, 0),
        (12, 11, 0),
        (12, 12, 0),
    ]
    m = metrics(engine.meter, 1.0, float("inf"), None)
    assert m["kv_waste_pct"] == 0.0 and m["kv_ahead_pct"] == pytest.approx(100 * 8 / 12)
    steady = PagedEngine(model, num_blocks=8, block_size=4, token_budget=64)
    run_engine(steady, [Request(list(range(1, 11)), 1)])  # one step: 10 tokens in 12 slots
    assert metrics(steady.meter, 1.0, float("inf"), None)["kv_waste_pct"] == pytest.approx(100 * 2 / 12)


def test_tpot_is_not_applicable_when_every_request_makes_one_token(model):
    engine = ContiguousEngine(model)
    run_engine(engine, [Request([1, 2, 3], 1), Request([4, 5], 1)])
    m = metrics(engine.meter, 1.0, float("inf"), None)
    assert m["tpot_ms_mean"] is None and m["prefix_hit_rate"] is None
    assert cell(None) == "—" and cell(31050.4) == "31,050" and cell(0.123) == "0.12"


def test_agreement_is_the_share_of_an_output_identical_before_its_first_difference():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert agreement([5, 2], [1, 2]) == 0.0
    assert agreement([1, 2], [1, 2, 3, 4]) == 0.5  # one stopped early (eos): the rest differs
    assert agreement([], []) == 1.0


class TokenClock(Observer):
    """A fake clock that a step moves by one second per token its forward computes, and nothing else moves:
    every time a request is stamped with is known before the run."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds

    def planned(self, plan):  # after the Meter's: its step starts before the forward's seconds, ends after
        self.t += sum(n for _, n in plan)


@pytest.mark.parametrize("design", ["contiguous", "paged"])
def test_every_figure_equals_its_value_worked_out_by_hand_on_a_fake_clock(model, design):
    """a (4 prompt tokens, 3 new) and b (2, 1) arrive at 0 s. Step 0 computes 4 + 2 tokens: 0 -> 6 s; a and b
    take their first tokens, and b is done. c (3, 2) arrives at 6 s. Step 1: a's decode and c's prompt, 1 + 3
    tokens: -> 10 s. Step 2: a decode each, -> 12 s; a and c are done. Both designs run this schedule; they
    keep K/V apart (a block: 4 slots)."""
    clock = TokenClock()
    if design == "contiguous":
        engine = ContiguousEngine(model)
    else:
        engine = PagedEngine(model, num_blocks=16, block_size=4, prefix_cache=False)
    engine.meter = Meter(engine, clock)
    engine.observers.append(clock)
    requests = [Request([1, 2, 3, 4], 3), Request([5, 6], 1), Request([7, 8, 9], 2)]
    run_engine(engine, requests, arrivals=[0, 0, 1])
    arrival = [engine.meter.arrival[r] for r in requests]
    assert arrival == [0, 0, 6] and [s["seconds"] for s in engine.meter.steps] == [6, 4, 2]
    assert [engine.meter.first_token[r] for r in requests] == [6, 6, 10] and list(engine.meter.done) == [
        requests[1],
        requests[0],
        requests[2],
    ]
    ttft = [6000, 6000, 10000 - 6000]  # ms, from each one's arrival
    latency = [12000, 6000, 12000 - 6000]
    tpot = [(12000 - 6000) / 2, (12000 - 10000) / 1]  # b made one token: no TPOT
    want = dict(
        output_tokens=6,
        wall_s=12,
        output_tok_s=0.5,
        ttft_ms_mean=sum(ttft) / 3,
        ttft_ms_p90=6000,  # 90% of the way from rank 1 to rank 2 of [4000, 6000, 6000]
        ttft_ms_p99=6000,
        tpot_ms_mean=sum(tpot) / 2,
        latency_ms_mean=sum(latency) / 3,
        latency_ms_p50=6000,  # rank 1 of [6000, 6000, 12000]
        latency_ms_p90=6000 + 0.8 * 6000,
        latency_ms_p99=6000 + 0.98 * 6000,
        normalized_latency_ms=(12000 / 3 + 6000 / 1 + 6000 / 2) / 3,
        request_rate=float("inf"),
        steps=3,
        prefill_tokens=4 + 2 + 3,
        preemptions=0,
        recomputed_tokens=0,
        recompute_ms=0,
        running_peak=2,
        running_mean=2,
        kv_budget_slots=None,
    )
    if design == "contiguous":  # K/V grow with the tokens: each step holds just what it computed
        used = [4 + 2, 5 + 3, 6 + 4]
        want.update(kv_used_pct_mean=100, kv_slots_allocated_peak=10, kv_slots_used_peak=10, prefix_hit_rate=None)
        want.update(kv_waste_pct=0, kv_ahead_pct=0)
        assert [(s["allocated"], s["used"]) for s in engine.meter.steps] == [(u, u) for u in used]
    else:  # blocks: a 1, b 1 (8 slots for 6); a 2, c 1 (12 for 5 + 3); a 2, c 1 (12 for 6 + 4)
        want.update(kv_used_pct_mean=100 * (6 / 8 + 8 / 12 + 10 / 12) / 3, kv_slots_allocated_peak=12)
        want.update(kv_slots_used_peak=8, kv_waste_pct=100 * 4 / 12, kv_ahead_pct=0, prefix_hit_rate=0)
        want.update(num_blocks=16, block_size=4, preemption="recompute", swap_blocks=0, swap_fallbacks=0)
        want.update(swapped_out_blocks=0, swapped_in_blocks=0, swap_mb=0, swap_out_ms=0, swap_in_ms=0)
    assert metrics(engine.meter, clock.t, float("inf"), None) == pytest.approx(want)


def test_samples_that_end_apart_are_timed_by_their_longest(model):
    """n samples with an eos: the request's latency runs to its last sample's end, so its normalized latency and
    time per output token divide by its longest sample's tokens (not the first sample's, which may end first)."""
    from ext import engine_class
    from sequence import SamplingParams

    probe = Request([5, 6, 7], 12, SamplingParams(temperature=1.5, seed=3, n=4))
    run_engine(engine_class(forks=True)(model, num_blocks=64, block_size=4), [probe])
    eos = probe.sequences[0].generated[2]  # the first sample ends at its third token, others later or never
    r = Request([5, 6, 7], 12, SamplingParams(temperature=1.5, seed=3, n=4, eos=eos))
    engine = engine_class(forks=True)(model, num_blocks=64, block_size=4)
    clock = TokenClock()
    engine.meter = Meter(engine, clock)
    engine.observers.append(clock)
    run_engine(engine, [r])
    lengths = [len(s.generated) for s in r.sequences]
    assert lengths[0] == 3 and max(lengths) > 3
    m = metrics(engine.meter, clock.t, float("inf"), None)
    latency = (engine.meter.done[r] - engine.meter.arrival[r]) * 1000
    decode = (engine.meter.done[r] - engine.meter.first_token[r]) * 1000
    assert m["normalized_latency_ms"] == pytest.approx(latency / max(lengths))
    assert m["tpot_ms_mean"] == pytest.approx(decode / (max(lengths) - 1))


def test_the_meter_hears_every_request_end_under_async_steps(model):
    """With async steps (ext/async_steps.py, the GPU path's default; here on the CPU, padded without capture) a
    request's last token reaches the host a step after its last plan: the Meter still hears it end, so every
    request and token is counted (it heard 1 of 4, and a quarter of the tokens)."""
    from ext import engine_class
    from sequence import SamplingParams

    engine = engine_class(compile="graph")(model, num_blocks=64, block_size=4, compile="graph", async_steps=True)
    clock = TokenClock()
    engine.meter = Meter(engine, clock)
    engine.observers.append(clock)
    requests = [Request([5, 6, 7], n, SamplingParams(temperature=0)) for n in (3, 6, 10, 20)]
    for r in requests:
        engine.add(r)
    while engine.waiting or engine.running or getattr(engine, "pending", None):
        engine.step()
    assert set(engine.meter.done) == set(requests)
    m = metrics(engine.meter, clock.t, float("inf"), None)
    assert m["output_tokens"] == 3 + 6 + 10 + 20


def test_a_sweep_tables_columns_line_up_under_its_headers_whatever_its_labels():
    from harness.metrics import sweep_table

    text = sweep_table([("recompute, block size 16", {"a": 1.5}), ("swap, block size 128", {"a": 20})], [("ms", "a")])
    header, *rows = text.splitlines()
    assert all(len(row) == len(header) for row in rows), text  # each value ends under its header
