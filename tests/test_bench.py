"""What the benchmarks claim about their own alternatives: the two-level top-k of bench/sampling.py is exact,
decode_attention.py's ragged and flex paths and gpu.py's flex candidate attend as the engine does, and
async_step.py's candidate gives the engine's tokens. tests/test_bench_scripts.py runs each script."""

import random
import time

import pytest
import torch
from conftest import run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_eos import common_token
from test_robust import workloads

from bench.sampling import two_level_topk
from ext import ServingEngine
from paged import blocks_for, gather_attend
from sequence import Request, RequestStatus, SamplingParams


@pytest.mark.parametrize("vocab", [50304, 50257, 3300, 100])
@pytest.mark.parametrize("k", [1, 200])
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
    from bench.sampling import run

    for temperature in (0.0, 0.8):
        tok_s, ms_per_step, outputs = run(model, [[1, 2, 3], [4, 5]], [3, 4], temperature)
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


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_flex_paged_candidate_reads_each_rows_own_keys(block_size):
    """bench/gpu.py's flex_attention candidate: eager, where mask_mod masks every key, it attends as gather_attend
    does, in float64; and its block mask, as flex's kernel reads it (whole blocks unmasked, mask_mod only in the
    partial ones), names exactly each row's first kv_len keys, whatever stale ids sit past a row's blocks, in the
    layout flex's decoding kernel reads: whole blocks' indices, if any, laid out as the partial ones'."""
    from bench.gpu import flex_block_mask, flex_paged_attend

    g = torch.Generator().manual_seed(block_size)
    B, W, H, D, num_pool_blocks = 6, 5, 3, 8, 40
    k_pool, v_pool = (torch.randn(num_pool_blocks, block_size, H, D, dtype=torch.float64, generator=g) for _ in "kv")
    table = torch.randperm(num_pool_blocks - 1, generator=g)[: B * W].view(B, W).int()
    kv_len = torch.randint(1, W * block_size + 1, (B,), generator=g)
    kv_len[0] = W * block_size  # every block whole
    kv_len[1] = 1
    table[1, 1:] = table[1, 0]  # a stale entry that names the row's own block again
    table[2], kv_len[2] = num_pool_blocks - 1, 1  # a padding row: one key, in the padding block, named W times
    mask = flex_block_mask(table, kv_len, num_pool_blocks, block_size)
    q = torch.randn(B, H, D, dtype=torch.float64, generator=g)
    assert torch.allclose(flex_paged_attend(q, k_pool, v_pool, mask), gather_attend(q, k_pool, v_pool, table, kv_len))
    assert mask.kv_indices.shape == (B, 1, 1, W) and mask.kv_indices.is_contiguous()
    whole = mask.full_kv_indices
    assert whole is None or (whole.shape, whole.stride()) == (mask.kv_indices.shape, mask.kv_indices.stride())
    for b in range(B):
        read = set()
        for j in [] if whole is None else whole[b, 0, 0, : mask.full_kv_num_blocks[b, 0, 0]].tolist():
            read |= set(range(j * block_size, (j + 1) * block_size))
        for j in mask.kv_indices[b, 0, 0, : mask.kv_num_blocks[b, 0, 0]].tolist():
            keys = torch.arange(j * block_size, (j + 1) * block_size)
            read |= {k for k in keys.tolist() if mask.mask_mod(torch.tensor(b), 0, 0, torch.tensor(k))}
        slots = table[b].long()[:, None] * block_size + torch.arange(block_size)  # (W, block_size)
        assert read == set(slots.flatten()[: kv_len[b]].tolist())


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


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_flex_candidate_in_whole_padded_steps_gives_the_engines_tokens_under_preemption(model, monkeypatch, block_size):
    """bench/gpu.py's FlexBatch, in every padded decode step of an engine (eager flex on the CPU, as its compiled
    form refuses the mask there): samples, beams and preemption give the engine's own tokens, in float64."""
    from test_decode_graphs import mixed_requests

    from bench import gpu

    monkeypatch.setattr(gpu, "compiled_flex", lambda: gpu.flex_paged_attend)
    rng = random.Random(block_size)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    num_blocks = 3 * blocks_for(20 + 12, block_size) + 4  # preempts: a beam group of the longest prompt, and 4
    outputs, flex_steps = {}, []
    attend = gpu.FlexBatch.attend_one_token
    monkeypatch.setattr(
        gpu.FlexBatch, "attend_one_token", lambda b, *a: flex_steps.append(b.padded_shape) or attend(b, *a)
    )
    for compile in ["off", "graph"]:
        engine = gpu.FlexEngine(
            model, num_blocks=num_blocks, block_size=block_size, token_budget=16, max_batch=12, compile=compile
        )
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[compile] = [[s.generated for s in r.sequences] for r in requests]
        assert engine.meter.num_preemptions > 0
    assert outputs["graph"] == outputs["off"]
    assert sum(shape is not None for shape in flex_steps) > 10  # padded steps that went through flex


def async_workload(eos=None):
    """Greedy requests, n = 3 samples with top-k, and one-token requests, all with eos."""
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(2, 20))] for _ in range(10)]
    news = [rng.randint(8, 30) for _ in prompts]
    params = [SamplingParams(eos=eos) for _ in range(4)]
    params += [SamplingParams(temperature=1.0, top_k=40, seed=i, n=3, eos=eos) for i in range(4)]
    params += [SamplingParams(eos=eos)] * 2
    news[-2:] = [1, 1]
    return [Request(p, n, sp) for p, n, sp in zip(prompts, news, params)]


def count_late_tokens(engine):
    """Wrap the candidate's resolve: -> a list that gets, for each call, whether the tokens it brings to the host
    were still on the device when the next step launched (a step ran while they were in flight). And check what
    the candidate relies on: no sequence is preempted while tokens are in flight, and a request finishes with
    every token on the host (a placeholder is negative)."""
    late, resolve, preempt, finish = [], engine.resolve, engine.preempt, engine.finish

    def preempt_none_in_flight(group):
        assert engine.pending is None, "preempted while tokens are in flight"
        preempt(group)

    def finish_with_every_token(r):
        assert all(t >= 0 for s in r.sequences for t in s.tokens), "a request finished before its tokens came"
        finish(r)

    engine.resolve = lambda: late.append(engine.pending is not None and bool(engine.running)) or resolve()
    engine.preempt, engine.finish = preempt_none_in_flight, finish_with_every_token
    return late


@pytest.mark.parametrize(
    "num_blocks,block_size,compile,preempts", [(400, 4, "off", False), (60, 1, "graph", True), (26, 4, "graph", True)]
)
def test_async_candidate_gives_the_engines_tokens(model, num_blocks, block_size, compile, preempts):
    """bench/async_step.py: with each step's tokens left on the device until the next step is launched, every
    sequence's tokens are the engine's own, in float64, for greedy and sampled requests, eos one step late,
    one-token requests, later arrivals, padded steps, and a pool that preempts (where it waits for the tokens
    first); every block comes back."""
    from bench.async_step import AsyncPagedEngine

    kw = dict(num_blocks=num_blocks, block_size=block_size, token_budget=16, max_batch=12, compile=compile)
    arrivals = [0, 0, 0, 2, 2, 5, 9, 9, 14, 14]
    sync = async_workload()
    run_engine(ServingEngine(model, **kw), sync, arrivals)
    eos = common_token([s.generated for r in sync for s in r.sequences])
    outputs, counts = {}, {}
    for cls in (ServingEngine, AsyncPagedEngine):
        engine = cls(model, **kw)
        requests = async_workload(eos)
        late = count_late_tokens(engine) if cls is AsyncPagedEngine else []
        run_engine(engine, requests, arrivals, check=True)
        outputs[cls] = [[s.generated for s in r.sequences] for r in requests]
        done = sum(r.status is RequestStatus.DONE for r in requests)  # every request, its tokens on the host
        counts[cls] = (done, engine.allocator.num_free(), engine.meter.num_preemptions)
    assert outputs[AsyncPagedEngine] == outputs[ServingEngine]
    assert any(len(o) < r.max_new_tokens for r, out in zip(requests, outputs[ServingEngine]) for o in out)  # eos hit
    assert counts[AsyncPagedEngine][:2] == counts[ServingEngine][:2] == (len(requests), num_blocks)
    assert sum(late) > 20
    assert (counts[AsyncPagedEngine][2] > 0) == (counts[ServingEngine][2] > 0) == preempts


def test_async_candidate_steps_beams_in_the_engines_order(model):
    """With a beam group live, the candidate waits for each step's tokens, as beams need their log-probabilities
    on the host: beams and the requests beside them give the engine's tokens."""
    from bench.async_step import AsyncPagedEngine

    outputs = []
    for cls in (ServingEngine, AsyncPagedEngine):
        requests = async_workload()[:4] + [Request([3, 1, 4, 1, 5], 9, SamplingParams(num_beams=3))]
        run_engine(cls(model, num_blocks=200, block_size=4, token_budget=16, max_batch=12), requests, [0, 0, 3, 3, 6])
        outputs.append([[s.generated for s in r.sequences] for r in requests])
    assert outputs[0] == outputs[1]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    w=workloads(),
    eos_pick=st.integers(0, 10**6),
    swap=st.booleans(),
    compile=st.sampled_from(["off", "graph"]),
    samples=st.integers(1, 3),
)
def test_async_candidate_matches_the_engine_on_random_workloads(model, w, eos_pick, swap, compile, samples):
    """The candidate against the engine on test_robust's random workloads, with an eos drawn from the engine's
    own output (so that some sequences stop early), n samples in every other request, swap or recompute
    preemption, and padded steps or not: every sequence's tokens the same, the invariants after every step,
    and no preemption with a token in flight."""
    from bench.async_step import AsyncPagedEngine

    sizes = {name: w[name] for name in ("num_blocks", "block_size", "token_budget", "max_batch", "prefix_cache")}
    sizes.update(compile=compile, swap_blocks=w["num_blocks"] // 2 if swap else 0)

    def requests(eos):
        n = [min(samples, w["max_batch"], w["token_budget"]) if i % 2 else 1 for i in range(len(w["news"]))]
        params = [
            SamplingParams(temperature=w["temperature"], top_k=40, seed=i, n=n[i], eos=eos) for i in range(len(n))
        ]
        return [Request(p, m, sp) for p, m, sp in zip(w["prompts"], w["news"], params)]

    def outputs(engine, eos, check=False):
        rs = requests(eos)
        run_engine(engine, rs, w["arrivals"], check=check)
        return [[s.generated for s in r.sequences] for r in rs]

    free = [t for out in outputs(ServingEngine(model, **sizes), None) for seq in out for t in seq]
    eos = free[eos_pick % len(free)]
    want = outputs(ServingEngine(model, **sizes), eos)
    engine = AsyncPagedEngine(model, **sizes)
    count_late_tokens(engine)
    assert outputs(engine, eos, check=True) == want
    assert engine.allocator.num_free() == w["num_blocks"] and engine.pending is None


def test_decode_attention_bench_gives_flex_the_engines_attention_in_the_cpu_form():
    """bench/decode_attention.py's flex path, in the form inductor's CPU template takes (a 4-D query, the mask as
    wide as the pool), attends as the engine's gather_attend does, rows of different lengths included (eager)."""
    from bench.decode_attention import case, flex_attend, flex_inputs

    inputs = case(6, 40, True, torch.float64)
    torch.testing.assert_close(flex_attend(*flex_inputs(*inputs)), gather_attend(*inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_candidate_compiled_on_cuda_attends_as_gather_attend(dtype):
    """bench/gpu.py's flex candidate as its GPU kernel runs it (compiled, static shapes: flex's decoding kernel)
    against gather_attend, at 1, 2 and 16 rows of spread lengths, stale table entries and a padding row."""
    from bench.gpu import compiled_flex, flex_block_mask

    g = torch.Generator().manual_seed(0)
    W, block_size, H, D = 8, 16, 12, 64
    for B in (1, 2, 16):
        num_pool_blocks = B * W + 1
        k_pool, v_pool = (torch.randn(num_pool_blocks, block_size, H, D, generator=g).to("cuda", dtype) for _ in "kv")
        table = torch.randperm(num_pool_blocks - 1, generator=g)[: B * W].view(B, W).int()
        kv_len = torch.randint(1, W * block_size + 1, (B,), generator=g)
        if B > 1:
            table[-1], kv_len[-1] = num_pool_blocks - 1, 1  # a padding row
        table, kv_len = table.cuda(), kv_len.cuda()
        q = torch.randn(B, H, D, generator=g).to("cuda", dtype)
        mask = flex_block_mask(table, kv_len, num_pool_blocks, block_size)
        got = compiled_flex()(q, k_pool, v_pool, mask).float()
        want = gather_attend(q, k_pool, v_pool, table, kv_len).float()
        assert (got - want).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2), B


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["off", "graph"])
def test_async_candidate_on_cuda_gives_the_engines_tokens(model, compile):
    """bench/async_step.py on a GPU, where its tokens really are in flight (pinned copies, events, placeholders
    swapped on the device): the float64 engine's tokens, with eos, samples and later arrivals, eagerly and with
    captured decode steps."""
    import copy

    from bench.async_step import AsyncPagedEngine

    cuda_model = copy.deepcopy(model).cuda()
    kw = dict(num_blocks=60, block_size=4, token_budget=16, max_batch=12, compile=compile)
    arrivals = [0, 0, 0, 2, 2, 5, 9, 9, 14, 14]
    sync = async_workload()
    run_engine(ServingEngine(model, num_blocks=60, block_size=4, token_budget=16, max_batch=12), sync, arrivals)
    eos = common_token([s.generated for r in sync for s in r.sequences])
    want = async_workload(eos)
    run_engine(ServingEngine(model, num_blocks=60, block_size=4, token_budget=16, max_batch=12), want, arrivals)
    engine = AsyncPagedEngine(cuda_model, **kw)
    late = count_late_tokens(engine)
    got = async_workload(eos)
    run_engine(engine, got, arrivals, check=True)
    assert [[s.generated for s in r.sequences] for r in got] == [[s.generated for s in r.sequences] for r in want]
    assert sum(late) > 20
