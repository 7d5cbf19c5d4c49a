"""The CUDA extension (ext/cuda.py). Decode steps in fixed shapes, as CUDA graphs replay them: padded to a batch
bucket and a block-table width, reading fixed input buffers. The padding is the same on every device, so these
run on the CPU (compile="graph" pads without capturing); tests/test_paged.py runs the captured graphs on CUDA.
Its two switches, each "auto" (on in the GPU path, off on a CPU): async_steps (ext/async_steps.py) and
decode_attention="flex" (ext/flex_decode.py), each the engine's own tokens on the CPU, and on CUDA where there is
one."""

import copy
import math
import random

import pytest
import torch
from conftest import run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_eos import common_token
from test_robust import workloads

from ext import ServingEngine, engine_class
from ext.cuda import FLEX_FROM_ROWS, FlexBatch, GraphBatch
from ext.flex_decode import compiled_flex, flex_block_mask
from paged import blocks_for, gather_attend
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams


def mixed_requests(prompts):
    """Plain greedy requests, n = 3 samples with top-k, and beam groups of 3."""
    plain = [Request(p, 10) for p in prompts[:3]]
    params = [SamplingParams(temperature=1.0, top_k=30, seed=i, n=3) for i in range(3)]
    samples = [Request(p, 12, sp) for p, sp in zip(prompts[3:6], params)]
    return plain + samples + [Request(p, 8, SamplingParams(num_beams=3)) for p in prompts[6:9]]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_padded_decode_steps_give_the_unpadded_tokens_under_preemption_forks_and_beams(model, block_size):
    rng = random.Random(block_size)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    worst = 3 * blocks_for(20 + 12, block_size)  # a beam group of the longest prompt
    outputs, shapes = {}, []
    for compile in ["off", "graph"]:
        engine = ServingEngine(
            model, num_blocks=worst + 4, block_size=block_size, token_budget=16, max_batch=12, compile=compile
        )

        def recorded(plan, samplers, make_batch=engine.make_batch, compile=compile):
            batch = make_batch(plan, samplers)
            shapes.append((compile, len(plan), getattr(batch, "padded_shape", None)))
            return batch

        engine.make_batch = recorded
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[compile] = [[s.generated for s in r.sequences] for r in requests]
        assert engine.meter.num_preemptions > 0  # the pool is small enough to preempt
    assert outputs["graph"] == outputs["off"]
    padded = [(rows, shape) for compile, rows, shape in shapes if shape is not None]
    assert all(compile == "graph" for compile, _, shape in shapes if shape is not None)
    assert any(shape[0] > rows for rows, shape in padded), "no step was padded to a larger batch"
    assert len({shape for _, shape in padded}) > 1, "the steps used a single batch bucket"


def test_graph_shapes_are_the_buckets_and_a_step_takes_the_smallest_that_holds_it(model):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=40, compile="graph")
    assert engine.graph_batches == [1, 2, 4, 8, 16, 32, 40]
    # every row reads as many blocks as a whole context has: 64 tokens in blocks of 4
    shapes = {rows: tuple(engine.graph_inputs[engine.graph_batch(rows)].one_token_table.shape) for rows in (1, 3, 33)}
    assert shapes == {1: (1, 16), 3: (4, 16), 33: (40, 16)}


def test_padded_steps_read_their_graphs_fixed_inputs_which_never_move(model):
    """A captured graph reads its inputs at fixed addresses: each padded step's tensors are its bucket's
    GraphInputs, allocated once, whatever prefill steps of other sizes run between them."""
    engine = ServingEngine(model, num_blocks=200, block_size=4, token_budget=64, max_batch=16, compile="graph")
    addresses = {b: [t.data_ptr() for t in inputs.fields()] for b, inputs in engine.graph_inputs.items()}
    padded = []

    def recorded(plan, samplers, make_batch=engine.make_batch):
        batch = make_batch(plan, samplers)
        if isinstance(batch, GraphBatch):
            fields = [batch.idx, batch.positions, batch.logit_rows, batch.slots, batch.one_token_len]
            padded.append(all(a is b for a, b in zip(fields + [batch.one_token_table], batch.inputs.fields())))
        return batch

    engine.make_batch = recorded
    rng = random.Random(0)
    requests = [Request([rng.randrange(300) for _ in range(rng.randint(1, 60))], 4) for _ in range(16)]
    run_engine(engine, requests, check=True)
    assert padded and all(padded), "a padded step read tensors of its own"
    assert addresses == {b: [t.data_ptr() for t in inputs.fields()] for b, inputs in engine.graph_inputs.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_give_the_eager_engines_tokens(model):
    """On CUDA, compile graph captures one graph per decode shape; replays give eager's tokens, float64."""
    cuda_model = copy.deepcopy(model).cuda()
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    outputs = {}
    for compile in ["on", "graph"]:
        engine = ServingEngine(cuda_model, num_blocks=100, block_size=4, token_budget=16, max_batch=12, compile=compile)
        assert bool(engine.graphs) == (compile == "graph")
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[compile] = [[s.generated for s in r.sequences] for r in requests]
    assert outputs["graph"] == outputs["on"]


def test_a_capture_batch_with_no_plan_is_all_padding_and_runs_the_forward(model):
    """What capture_graphs records each graph from, on the CPU: a batch of no sequence, every row padding (token
    0 at position 0, written to and read from the padding block), in its bucket's fixed inputs."""
    engine = ServingEngine(model, num_blocks=20, block_size=4, max_batch=8, compile="graph")
    padding = engine.allocator.num_blocks
    for b, inputs in engine.graph_inputs.items():
        batch = engine.padded_batch([], [], inputs)
        assert batch.idx is inputs.idx and batch.one_token_table is inputs.one_token_table
        assert batch.slots.tolist() == [padding * engine.block_size] * b and batch.one_token_len.tolist() == [1] * b
        assert (batch.one_token_table == padding).all() and batch.idx.tolist() == [0] * b
        with torch.no_grad():  # as capture_graphs runs it: every padded row's logits
            logits = PagedEngine.forward(engine, batch)
            assert engine.forward(batch).shape == (0, model.config.vocab_size), "padding's logits were returned"
        assert logits.shape == (b, model.config.vocab_size) and torch.isfinite(logits).all()
    assert engine.kv_pool[:, :, :padding].abs().sum() == 0, "a padding row wrote outside the padding block"


def test_the_switches_are_auto_and_off_on_a_cpu_and_one_setting_each(model):
    """async_steps and decode_attention are "auto": on only in the GPU path (CUDA with compile "graph"), where a GPU
    measured them; each is a setting of the engine with the CUDA extension, as generate.py composes it. flex
    attends padded steps only, and on CUDA only with blocks that its kernel takes."""
    engine = ServingEngine(model, num_blocks=20, compile="graph")
    assert engine.async_steps is False and engine.flex_from == math.inf
    engine = engine_class(compile="graph")(
        model, num_blocks=20, compile="graph", async_steps=True, decode_attention="flex"
    )
    assert engine.async_steps is True and engine.flex_from == 1
    assert isinstance(engine.padded_batch([], [], engine.graph_inputs[1]), FlexBatch)
    engine = ServingEngine(model, num_blocks=20, compile="graph", decode_attention="gather")
    assert type(engine.padded_batch([], [], engine.graph_inputs[1])) is GraphBatch
    for compile, attention in [("off", "flex"), ("graph", "sdpa"), ("auto", "flex")]:
        with pytest.raises(ValueError, match="decode_attention"):
            ServingEngine(model, num_blocks=20, compile=compile, decode_attention=attention)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_path_turns_its_switches_on_and_refuses_flex_with_small_blocks(model):
    """On CUDA with compile "graph": async steps, and flex in the buckets of FLEX_FROM_ROWS rows or more (gather
    below); flex with blocks narrower than its kernel takes is refused with one line, and auto falls back to
    gather_attend in every bucket."""
    cuda_model = copy.deepcopy(model).cuda()
    engine = ServingEngine(cuda_model, num_blocks=40, block_size=16, max_batch=80, compile="graph")
    assert engine.async_steps is True and engine.flex_from == FLEX_FROM_ROWS
    assert type(engine.padded_batch([], [], engine.graph_inputs[48])) is GraphBatch
    assert isinstance(engine.padded_batch([], [], engine.graph_inputs[64]), FlexBatch)
    with pytest.raises(ValueError, match="blocks of 16 or more"):
        ServingEngine(cuda_model, num_blocks=40, block_size=4, compile="graph", decode_attention="flex")
    engine = ServingEngine(cuda_model, num_blocks=40, block_size=4, max_batch=4, compile="graph")
    assert engine.flex_from == math.inf


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_flex_decode_attention_in_padded_steps_gives_the_engines_tokens_under_preemption(
    model, monkeypatch, block_size
):
    """decode_attention="flex" in every padded decode step (eager flex on the CPU, as inductor's CPU template
    refuses the mask): samples, beams and preemption give the engine's own tokens, in float64."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    num_blocks = 3 * blocks_for(20 + 12, block_size) + 4  # preempts: a beam group of the longest prompt, and 4
    flex_steps = []
    attend = FlexBatch.attend_one_token
    monkeypatch.setattr(FlexBatch, "attend_one_token", lambda b, *a: flex_steps.append(b.padded_shape) or attend(b, *a))
    outputs = {}
    for compile, attention in [("off", "gather"), ("graph", "flex")]:
        sizes = dict(num_blocks=num_blocks, block_size=block_size, token_budget=16, max_batch=12)
        engine = ServingEngine(model, **sizes, compile=compile, decode_attention=attention)
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[attention] = [[s.generated for s in r.sequences] for r in requests]
        assert engine.meter.num_preemptions > 0
    assert outputs["flex"] == outputs["gather"]
    assert len(flex_steps) > 10  # padded steps that went through flex


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
    """Wrap the async engine's resolve: -> a list that gets, for each call, whether the tokens it brings to the host
    were still on the device when the next step launched (a step ran while they were in flight). And check what
    async steps rely on: no sequence is preempted while tokens are in flight, and a request finishes with every
    token on the host (a placeholder is negative)."""
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
def test_async_steps_give_the_engines_tokens(model, num_blocks, block_size, compile, preempts):
    """async_steps: with each step's tokens left on the device until the next step is launched, every sequence's
    tokens are the engine's own, in float64, for greedy and sampled requests, eos one step late, one-token
    requests, later arrivals, padded steps, and a pool that preempts (where it waits for the tokens first); every
    block comes back."""
    kw = dict(num_blocks=num_blocks, block_size=block_size, token_budget=16, max_batch=12, compile=compile)
    arrivals = [0, 0, 0, 2, 2, 5, 9, 9, 14, 14]
    sync = async_workload()
    run_engine(ServingEngine(model, **kw), sync, arrivals)
    eos = common_token([s.generated for r in sync for s in r.sequences])
    outputs, counts = {}, {}
    for async_steps in (False, True):
        engine = ServingEngine(model, **kw, async_steps=async_steps)
        requests = async_workload(eos)
        late = count_late_tokens(engine) if async_steps else []
        run_engine(engine, requests, arrivals, check=True)
        outputs[async_steps] = [[s.generated for s in r.sequences] for r in requests]
        done = sum(r.status is RequestStatus.DONE for r in requests)  # every request, its tokens on the host
        counts[async_steps] = (done, engine.allocator.num_free(), engine.meter.num_preemptions)
    assert outputs[True] == outputs[False]
    assert any(len(o) < r.max_new_tokens for r, out in zip(requests, outputs[False]) for o in out)  # eos hit
    assert counts[True][:2] == counts[False][:2] == (len(requests), num_blocks)
    assert sum(late) > 20
    assert (counts[True][2] > 0) == (counts[False][2] > 0) == preempts


def test_async_steps_step_beams_and_speculation_in_the_engines_order(model):
    """With a beam group live, or speculation on, async steps wait for each step's tokens, as beams need their
    log-probabilities on the host and proposals the tokens: the engine's tokens, beside requests that stepped
    ahead before the beams arrived."""
    for speculate in (0, 3):
        outputs = []
        for async_steps in (False, True):
            requests = async_workload()[:4] + [Request([3, 1, 4, 1, 5], 9, SamplingParams(num_beams=3))]
            sizes = dict(num_blocks=200, block_size=4, token_budget=16, max_batch=12, num_speculative_tokens=speculate)
            engine = ServingEngine(model, **sizes, async_steps=async_steps)
            run_engine(engine, requests, [0, 0, 3, 3, 6])
            outputs.append([[s.generated for s in r.sequences] for r in requests])
        assert outputs[0] == outputs[1]


def test_async_steps_with_flex_decode_attention_give_the_engines_tokens(model):
    """Both switches at once, as the GPU path runs them: the engine's tokens."""
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    outputs = []
    for switches in ({}, dict(async_steps=True, decode_attention="flex")):
        engine = ServingEngine(
            model, num_blocks=40, block_size=4, token_budget=16, max_batch=12, compile="graph", **switches
        )
        requests = [Request(p, 12, SamplingParams(temperature=1.0, top_k=30, seed=i)) for i, p in enumerate(prompts)]
        outputs.append(run_engine(engine, requests, check=True))
    assert outputs[0] == outputs[1]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    w=workloads(),
    eos_pick=st.integers(0, 10**6),
    swap=st.booleans(),
    compile=st.sampled_from(["off", "graph"]),
    samples=st.integers(1, 3),
)
def test_async_steps_match_the_engine_on_random_workloads(model, w, eos_pick, swap, compile, samples):
    """Async steps against the engine on test_robust's random workloads, with an eos drawn from the engine's own
    output (so that some sequences stop early), n samples in every other request, swap or recompute preemption,
    and padded steps or not: every sequence's tokens the same, the invariants after every step, and no
    preemption with a token in flight."""
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
    engine = ServingEngine(model, **sizes, async_steps=True)
    count_late_tokens(engine)
    assert outputs(engine, eos, check=True) == want
    assert engine.allocator.num_free() == w["num_blocks"] and engine.pending is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_decode_attention_compiled_on_cuda_attends_as_gather_attend(dtype):
    """decode_attention="flex" as its GPU kernel runs it (compiled, static shapes: flex's decoding kernel) against
    gather_attend, at 1, 2 and 16 rows of spread lengths, stale table entries and a padding row."""
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
def test_flex_decode_attention_on_cuda_in_captured_steps_gives_gather_attends_tokens(model):
    """decode_attention="flex" in captured decode steps on a GPU (flex's kernel compiled for each bucket, its block
    mask built inside the graph), float32, as flex's GPU kernel takes: samples and beams under preemption give the
    tokens of the same engine attending through gather_attend."""
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    cuda_model = copy.deepcopy(model).to("cuda", torch.float32)
    # blocks of 16, the fewest keys flex's GPU kernel takes (triton's dot); the pool preempts, as the CPU test's
    sizes = dict(num_blocks=3 * blocks_for(20 + 12, 16) + 4, block_size=16, token_budget=16, max_batch=12)
    outputs = {}
    for attention in ("gather", "flex"):
        engine = ServingEngine(cuda_model, **sizes, compile="graph", decode_attention=attention)
        assert len(engine.graphs) == len(engine.graph_batches)
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[attention] = [[s.generated for s in r.sequences] for r in requests]
        assert engine.meter.num_preemptions > 0
    assert outputs["flex"] == outputs["gather"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["off", "graph"])
def test_async_steps_on_cuda_give_the_engines_tokens(model, compile):
    """async_steps on a GPU, where the tokens really are in flight (pinned copies, events, placeholders swapped on
    the device): the float64 CPU engine's tokens, with eos, samples and later arrivals, eagerly and with captured
    decode steps."""
    cuda_model = copy.deepcopy(model).cuda()
    kw = dict(num_blocks=60, block_size=4, token_budget=16, max_batch=12)
    arrivals = [0, 0, 0, 2, 2, 5, 9, 9, 14, 14]
    sync = async_workload()
    run_engine(ServingEngine(model, **kw), sync, arrivals)
    eos = common_token([s.generated for r in sync for s in r.sequences])
    want = async_workload(eos)
    run_engine(ServingEngine(model, **kw), want, arrivals)
    engine = ServingEngine(cuda_model, **kw, compile=compile, async_steps=True)
    late = count_late_tokens(engine)
    got = async_workload(eos)
    run_engine(engine, got, arrivals, check=True)
    assert [[s.generated for s in r.sequences] for r in got] == [[s.generated for s in r.sequences] for r in want]
    assert sum(late) > 20
