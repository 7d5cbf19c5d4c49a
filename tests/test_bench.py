"""What the benchmarks claim about their own alternatives: the two-level top-k (ext/logprobs.py's, which
bench/sampling.py also puts in topk's place) is exact,
decode_attention.py's ragged and flex paths attend as the engine does, and gpu.py times each step and runs each
repeat without the last one's prefix blocks. The GPU candidates are switches of the CUDA extension, tested with
it (tests/test_decode_graphs.py); tests/test_bench_scripts.py runs each script."""

import time

import pytest
import torch

from ext import ServingEngine
from ext.logprobs import two_level_topk
from paged import gather_attend


@pytest.mark.parametrize("vocab", [50304, 50257, 3300, 100])
@pytest.mark.parametrize("k", [0, 1, 5, 20, 200])
def test_two_level_topk_selects_exactly_what_torch_topk_does(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    for logits in [torch.randn(8, vocab, generator=g) * 3, torch.randint(0, 50, (8, vocab), generator=g).float()]:
        if k > vocab:
            continue
        values, ids = two_level_topk(logits, k)
        expected = logits.topk(k).values
        assert torch.equal(values, expected)  # the same k values, sorted, ties included
        assert torch.equal(logits.gather(1, ids), values)  # each id holds its value
        assert all(len(set(row)) == k for row in ids.tolist())  # no column twice


def test_sampling_bench_times_the_engines_own_sample_call(model):
    """bench/sampling.py wraps the engine's sample call; a rename in the engine must fail here, not there."""
    from bench.sampling import RUNS, run

    for compile in ("auto", "kernel"):
        for settings, logprobs in RUNS.values():  # each run's settings, on its engine
            tok_s, ms_per_step, outputs = run(model, [[1, 2, 3], [4, 5]], [3, 4], settings, logprobs, compile)
            assert [len(o) for o in outputs] == [3, 4]
            assert tok_s > 0 and ms_per_step > 0


def test_ragged_decode_attention_equals_the_engines_gather_attend():
    """bench/decode_attention.py's ragged path (each row's real blocks only) computes the engine's attention."""
    from bench.decode_attention import case, ragged_gather_attend, ragged_tables
    from paged import gather_attend

    for spread, shortest in [(False, 0.5), (True, 0.5), (True, 0.0)]:  # 0.0: rows down to a single key
        q, k_pool, v_pool, table, kv_len = case(5, 40, spread, torch.float64, shortest)
        kv_len = kv_len.clamp(min=1)
        expected = gather_attend(q, k_pool, v_pool, table, kv_len)
        got = ragged_gather_attend(q, k_pool, v_pool, *ragged_tables(table, kv_len))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_gpu_bench_times_each_step_and_runs_each_repeat_without_the_last_ones_prefix_blocks(model, monkeypatch):
    """bench/gpu.py's end to end: a repeat of the same prompts on one engine finds no block of the last run in the
    prefix cache (its blocks would skip prefill), gives the same tokens, and time_steps times every step, its
    phases summing to the step's wall time."""
    from bench import gpu
    from paged import BlockAllocator

    hits = []
    cached_prefix = BlockAllocator.cached_prefix
    monkeypatch.setattr(
        BlockAllocator, "cached_prefix", lambda self, *a: hits.append(cached_prefix(self, *a)) or hits[-1]
    )
    engine = ServingEngine(model, num_blocks=60, block_size=4, token_budget=32)
    prompts, news = [list(range(1, 30)), [5] * 9, list(range(40, 60))], [6, 9, 4]
    _, first = gpu.run_ours(engine, prompts, news)
    batches = []
    make_batch = engine.make_batch
    engine.make_batch = lambda *args: batches.append(make_batch(*args)) or batches[-1]
    steps = gpu.time_steps(engine)
    start = time.perf_counter()
    _, again = gpu.run_ours(engine, prompts, news)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert again == first
    assert len(hits) == 6 and all(h == [] for h in hits)  # each run: one lookup a prompt, no hit
    assert len(steps) == len(batches) >= max(news)
    assert {kind for kind, _ in steps} == {"eager"}  # no graphs on a CPU
    assert all(len(phases) == 4 and min(phases) >= 0 for _, phases in steps)
    assert 0.8 * wall_ms < sum(map(sum, (phases for _, phases in steps))) <= wall_ms


def test_decode_attention_bench_gives_flex_the_engines_attention_in_the_cpu_form():
    """bench/decode_attention.py's flex path, in the form inductor's CPU template takes (a 4-D query, the mask as
    wide as the pool), attends as the engine's gather_attend does, rows of different lengths included (eager)."""
    from bench.decode_attention import case, flex_attend, flex_inputs

    inputs = case(6, 40, True, torch.float64)
    torch.testing.assert_close(flex_attend(*flex_inputs(*inputs)), gather_attend(*inputs))
