"""The paged pool, the LIFO allocator, write/gather, gather-attend and the fused scheduler."""

import copy
import math
import random

import pytest
import torch
from conftest import baseline, make_requests, run_engine, tiny_gpt

from ext import ServingEngine
from paged import BlockAllocator, gather_attend, gather_kv, write_kv
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams


def test_lifecycle_prompt_blocks_then_one_more_when_decode_crosses_a_boundary(model):
    engine = PagedEngine(model, num_blocks=8, block_size=4, token_budget=64)
    r = Request(list(range(1, 13)), max_new_tokens=3)  # 12 tokens fill 3 blocks exactly
    engine.add(r)
    engine.step()  # admits and prefills all 12 tokens, samples token 13
    assert len(r.sequences[0].block_table) == 3 and engine.allocator.num_free() == 5
    engine.step()  # position 12 starts a 4th block
    assert len(r.sequences[0].block_table) == 4 and engine.allocator.num_free() == 4
    engine.step()
    assert r.status is RequestStatus.DONE and engine.allocator.num_free() == 8 and len(r.generated) == 3


def test_reuse_blocks_freed_by_a_finished_request_go_to_the_next_lifo(model):
    """The block freed last goes out first, where a lowest-free-id allocator would hand out the lowest."""
    alloc = BlockAllocator(10, block_size=4)
    first, second = alloc.allocate(3), alloc.allocate(2)  # [0, 1, 2], [3, 4]
    alloc.free(first)
    alloc.free(second)  # tail first, head last: 3 is on top
    assert alloc.allocate(3) == [3, 4, 0]  # lowest first: [0, 1, 2]
    engine = PagedEngine(model, num_blocks=10, block_size=4, token_budget=64, prefix_cache=False)
    a, c, b = Request([1, 2, 3, 4, 5, 6], 2), Request([7], 4), Request([8, 9, 10, 11, 12], 2)
    run_engine(engine, [a, c])  # a holds blocks 0 and 1 and finishes first; c holds block 2 and finishes last
    engine.add(b)
    engine.step()
    assert b.sequences[0].block_table == [2, 0]  # c's, then a's head; lowest first: [0, 1]


def test_exhausted_pool_admits_after_release(model):
    engine = PagedEngine(model, num_blocks=2, block_size=4, token_budget=64)
    big, small = Request(list(range(1, 9)), 1), Request([1, 2, 3, 4], 1)
    engine.add(big)
    engine.add(small)
    engine.step()  # big fills both blocks and finishes; small had to wait in that step
    assert big.status is RequestStatus.DONE and small.status is RequestStatus.WAITING
    engine.step()
    assert small.status is RequestStatus.DONE and engine.allocator.num_free() == 2


def test_allocating_from_an_empty_pool_raises_and_never_hands_out_twice():
    alloc = BlockAllocator(3, block_size=4)
    blocks = [alloc.allocate()[0] for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="1 blocks asked, 0 of 3 free"):
        alloc.allocate()
    with pytest.raises(RuntimeError, match="2 blocks asked, 0 of 3 free"):
        alloc.allocate(2)


def test_write_then_gather_round_trips_on_scattered_block_tables():
    H, NB, bs, D = 3, 20, 4, 5
    k_pool, v_pool = torch.zeros(NB, bs, H, D), torch.zeros(NB, bs, H, D)
    tables = [[17, 2, 9], [5], [11, 0, 14, 3]]
    lens = [10, 3, 16]
    k = [torch.randn(n, H, D) for n in lens]
    v = [torch.randn(n, H, D) for n in lens]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n)])
    write_kv(k_pool, v_pool, slots, torch.cat(k), torch.cat(v))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_got, v_got = gather_kv(k_pool, table), gather_kv(v_pool, table)  # (B, L, H, D)
    for i, n in enumerate(lens):
        assert torch.equal(k_got[i, :n], k[i]) and torch.equal(v_got[i, :n], v[i])


def reference_attention(q, keys, values):
    """q: (H, D), keys/values: (H, L, D) -> (H, D), plain softmax attention."""
    scores = (keys @ q[:, :, None])[:, :, 0] / math.sqrt(q.size(-1))
    return (scores.softmax(-1)[:, :, None] * values).sum(1)


@pytest.mark.parametrize(
    "dtype, device",
    [
        (torch.float32, "cpu"),
        (torch.bfloat16, "cpu"),
        pytest.param(
            torch.float32, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
        pytest.param(
            torch.bfloat16, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_gather_attend_matches_reference_attention(dtype, device):
    torch.manual_seed(0)
    H, NB, bs, D = 4, 40, 4, 8
    k_pool, v_pool = torch.randn(NB, bs, H, D, dtype=dtype), torch.randn(NB, bs, H, D, dtype=dtype)
    kv_len = torch.tensor([1, 4, 5, 8, 13, 16, 2])  # length 1, block boundaries, and between
    perm = torch.randperm(NB).tolist()
    tables = [perm[4 * i : 4 * i + -(-n // bs)] for i, n in enumerate(kv_len.tolist())]
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])  # padded width
    q = torch.randn(len(kv_len), H, D, dtype=dtype)
    fn = torch.compile(gather_attend) if device == "cuda" else gather_attend
    args = [t.to(device) for t in (q, k_pool, v_pool, table, kv_len)]
    got = fn(*args).cpu()
    for i, n in enumerate(kv_len.tolist()):
        keys = gather_kv(k_pool, table[i : i + 1])[0, :n].transpose(0, 1).float()  # (H, n, D)
        values = gather_kv(v_pool, table[i : i + 1])[0, :n].transpose(0, 1).float()
        want = reference_attention(q[i].float(), keys, values)
        # bf16: about one ulp at 1.0 (2**-7) on the CPU, where 20 seeds gave at most 2.2e-3; compiled CUDA looser
        tol = 1e-5 if dtype == torch.float32 else 8e-3 if device == "cpu" else 2e-2
        torch.testing.assert_close(got[i].float(), want, rtol=tol, atol=tol)


def random_workload(seed, n, max_prompt=30, max_new=25, vocab=300):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    return prompts, [rng.randint(1, max_new) for _ in range(n)], [rng.randint(0, 12) for _ in range(n)]


@pytest.mark.parametrize("block_size, token_budget", [(1, 256), (3, 256), (16, 256), (3, 7), (16, 5)])
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 30)])
def test_paged_equals_contiguous_token_for_token(model, block_size, token_budget, temperature, top_k):
    """Mixed prompt lengths, arrivals at different steps, and budgets smaller than a prompt, so prefill
    is chunked across steps while others decode."""
    from harness.observer import Observer
    from sequence import SequenceStatus

    class MixedSteps(Observer):  # steps where a prompt's chunk, short of its prompt, runs beside a decode
        count = 0

        def planned(self, plan):
            chunked = any(1 < n < s.num_uncomputed() for s, n in plan)
            decoding = any(s.status is SequenceStatus.DECODING for s, _ in plan)
            self.count += chunked and decoding

    prompts, news, arrivals = random_workload(block_size * 100 + token_budget, 14)
    want = baseline(model, prompts, news, temperature, top_k)
    engine = PagedEngine(model, num_blocks=400, block_size=block_size, token_budget=token_budget, max_batch=6)
    mixed = MixedSteps()
    engine.observers.append(mixed)
    got = run_engine(engine, make_requests(prompts, news, temperature, top_k), arrivals, check=True)
    assert got == want
    assert all(len(g) == n for g, n in zip(got, news))
    if token_budget < 30:
        assert mixed.count > 0, "no step ran a partial prompt chunk beside a decode"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["off", "on", "graph"])
def test_paged_on_cuda_equals_the_cpu_engines_token_for_token(model, compile):
    """The engine on a GPU (the float64 model, its pool, tables and sampling on the device) against the
    contiguous baseline on the CPU, greedy and sampled, in a roomy pool, in one that preempts and one sequence at
    a time (a lone row reads its blocks in place); then n samples and beams, every sequence, against the paged
    engine on the CPU."""
    cuda_model = copy.deepcopy(model).cuda()
    prompts, news, arrivals = random_workload(7, 12)
    for temperature, top_k in [(0.0, None), (1.0, 30)]:
        want = baseline(model, prompts, news, temperature, top_k)
        for num_blocks in (400, 24):
            engine = ServingEngine(  # compile "graph" pads and captures: the CUDA extension's
                cuda_model, num_blocks=num_blocks, block_size=4, token_budget=16, max_batch=6, compile=compile
            )
            requests = make_requests(prompts, news, temperature, top_k)
            assert run_engine(engine, requests, arrivals, check=True) == want
        assert engine.meter.num_preemptions > 0
        alone = ServingEngine(cuda_model, num_blocks=400, block_size=4, max_batch=1, compile=compile)  # lone rows
        assert run_engine(alone, make_requests(prompts, news, temperature, top_k), check=True) == want

    def forks():
        samples = [
            Request(p, 12, SamplingParams(temperature=1.0, top_k=30, seed=i, n=3)) for i, p in enumerate(prompts[:4])
        ]
        return samples + [Request(p, 8, SamplingParams(num_beams=3)) for p in prompts[4:7]]

    for num_blocks in (400, 40):  # samples and beams: the forks extension's, in the engine with every extension
        on_cpu, on_cuda = forks(), forks()
        run_engine(ServingEngine(model, num_blocks=num_blocks, block_size=4, token_budget=16, max_batch=12), on_cpu)
        engine = ServingEngine(
            cuda_model, num_blocks=num_blocks, block_size=4, token_budget=16, max_batch=12, compile=compile
        )
        run_engine(engine, on_cuda, check=True)
        for a, b in zip(on_cpu, on_cuda):
            assert [s.generated for s in a.sequences] == [s.generated for s in b.sequences]
    assert engine.meter.num_preemptions > 0


def test_prepare_turns_off_cudnn_attention_which_plans_every_new_shape_and_engines_leave_it(model):
    """On a GPU, SDPA's cuDNN backend builds a plan for each new shape, and a serving step's shapes change every
    step: bf16 ran 7x slower end to end with it on an H200 (docs/compile.md#on-a-gpu). harness.tuning.prepare, which the
    command line and example.py call, turns it off; an engine changes no process-wide setting."""
    from harness.contiguous import ContiguousEngine
    from harness.tuning import prepare

    engines = [PagedEngine, ServingEngine, ContiguousEngine]
    sizes = [dict(num_blocks=8), dict(num_blocks=8), {}]
    for engine, kw in zip(engines, sizes):
        torch.backends.cuda.enable_cudnn_sdp(True)
        engine(model, **kw)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    prepare(tiny_gpt())
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_compiled_decode_on_the_cpu_equals_eager_with_one_graph_and_no_recompiles(model):
    """Inductor on the CPU: the same greedy tokens as eager and as the baseline, with scattered block tables
    (preemption under a small pool, LIFO reuse), decode batches that shrink to one row (which runs eagerly), and
    steps that mix decode and chunks. The dynamic graph compiles once; nothing recompiles in the steady state."""
    from torch._dynamo.utils import counters

    rng = random.Random(5)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    news = [rng.randint(1, 30) for _ in prompts]
    expected = baseline(model, prompts, news)
    warm = PagedEngine(model, num_blocks=40, block_size=4, token_budget=24, max_batch=8, compile="on")
    run_engine(warm, make_requests(prompts[:3], news[:3]))  # compiles the graph this model's dtype needs
    graphs = counters["stats"]["unique_graphs"]
    for num_blocks in (40, 16):  # a roomy pool, then one that preempts
        engine = PagedEngine(model, num_blocks=num_blocks, block_size=4, token_budget=24, max_batch=8, compile="on")
        assert run_engine(engine, make_requests(prompts, news), check=True) == expected
    assert engine.meter.num_preemptions > 0
    assert counters["stats"]["unique_graphs"] == graphs, "a steady-state step recompiled"
    eager = PagedEngine(model, num_blocks=16, block_size=4, token_budget=24, max_batch=8, compile="off")
    assert run_engine(eager, make_requests(prompts, news)) == expected


@pytest.mark.parametrize(
    "sizes, compile",
    [
        (dict(num_blocks=40, block_size=4), "on"),
        # auto on a CPU compiles from 16 rows; 16 prompts of a block and more would not fit this token budget
        (dict(num_blocks=40, block_size=8, token_budget=64, prefix_cache=False), "auto"),
    ],
)
def test_warm_up_runs_a_compiled_decode_step_so_that_the_run_after_it_compiles_nothing(model, sizes, compile):
    """The command line's warm-up (harness.serving.warm_up) serves tiny prompts before anything is timed: their
    decode steps must reach the compiled decode attention, which starts at 2 rows of 2 blocks (16 rows with auto on
    a CPU), whatever the token budget, so that the timed run compiles nothing."""
    import gc

    from torch._dynamo.utils import counters

    from harness.serving import warm_up

    compiled = []

    class Recording(PagedEngine):
        def make_batch(self, plan, samplers):
            batch = super().make_batch(plan, samplers)
            compiled.append(batch.compiled)
            return batch

    try:
        warm_up(Recording(model, **sizes, compile=compile), 64)
    finally:
        gc.unfreeze()  # warm_up freezes the heap, as a served process does
    assert any(compiled), "the warm-up ran no compiled decode step"
    graphs = counters["stats"]["unique_graphs"]
    engine = PagedEngine(model, **sizes, compile=compile)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6], [7, 8, 9, 10, 11]] * 6
    news = [9, 12, 7] * 6
    assert run_engine(engine, make_requests(prompts, news)) == baseline(model, prompts, news)
    assert counters["stats"]["unique_graphs"] == graphs, "the run compiled"


def test_no_step_attention_falls_back_to_sdpas_math_path(model):
    """On the CPU, SDPA's fused kernel takes only 4-D inputs: a 3-D call silently runs its math path, which
    took 4.1 ms against 0.7 ms for one fresh 300-token chunk at 4 heads of 32 (torch 2.13). Fresh chunks,
    chunks after cached tokens and eager decode all run fused."""
    engine = PagedEngine(model, num_blocks=64, block_size=4, token_budget=16, compile="off")
    requests = make_requests([list(range(1, 40)), list(range(50, 60))], [6, 6])
    with torch.profiler.profile() as prof:
        run_engine(engine, requests)
    calls = {e.key: e.count for e in prof.key_averages() if "scaled_dot_product" in e.key}
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu", 0) > 0, calls
    assert "aten::_scaled_dot_product_attention_math" not in calls, calls


def test_a_lone_row_reads_its_blocks_in_place_where_they_follow_each_other_and_gives_the_baselines_tokens(model):
    """At batch 1 a decode row whose blocks follow each other (as the LIFO allocator hands a lone sequence them)
    attends over its own slots of the pool, in place and with no mask; one whose blocks do not (two sequences grew
    side by side, then one finished) gathers them. Both give the contiguous baseline's tokens, greedy and sampled,
    and the in-place keys are the pool's own memory."""
    steps = []

    class Recording(PagedEngine):
        def make_batch(self, plan, samplers):
            batch = super().make_batch(plan, samplers)
            steps.append((batch.num_one_token, batch.lone is not None))
            if batch.lone:
                slots = self.kv_pool[0, 0].flatten(0, 1)[batch.lone]
                assert slots.data_ptr() - self.kv_pool.data_ptr() == batch.lone.start * slots[0].numel() * 8
                assert len(slots) == batch.kv_lens[0]
            return batch

    prompts, news = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]], [20, 6]
    for temperature, top_k in [(0.0, None), (1.0, 30)]:
        want = baseline(model, prompts, news, temperature, top_k)
        for max_batch in (1, 2):
            engine = Recording(model, num_blocks=40, block_size=2, max_batch=max_batch, compile="off")
            assert run_engine(engine, make_requests(prompts, news, temperature, top_k), check=True) == want
    assert (1, True) in steps and (1, False) in steps  # both paths ran at batch 1
    assert all(rows == 1 for rows, lone in steps if lone)
