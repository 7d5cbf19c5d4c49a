"""What a run measures (metrics.py): Meter hears the engine's steps, metrics() turns them into vLLM's
benchmark figures (TTFT, TPOT, latency, percentiles) and the KV slots' use; --compare's agreement."""

import pytest
from conftest import run_engine

import generate
from contiguous import ContiguousEngine
from metrics import cell, metrics, percentile
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
    assert generate.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert generate.agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert generate.agreement([5, 2], [1, 2]) == 0.0
    assert generate.agreement([1, 2], [1, 2, 3, 4]) == 0.5  # one stopped early (eos): the rest differs
    assert generate.agreement([], []) == 1.0
