"""Decode steps in fixed shapes, as CUDA graphs replay them: padded to a batch bucket and a block-table width,
reading fixed input buffers (ext/cuda.py). The padding is the same on every device, so these run on the CPU
(compile="graph" pads without capturing); tests/test_paged.py runs the captured graphs on CUDA."""

import random

import pytest
import torch
from conftest import run_engine

from ext import ServingEngine
from ext.cuda import GraphBatch
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, SamplingParams


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
    import copy

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
        batch = engine.graph_batch_class([], [], engine.device, engine.kv_pool, engine.block_tables, inputs)
        assert batch.idx is inputs.idx and batch.one_token_table is inputs.one_token_table
        assert batch.slots.tolist() == [padding * engine.block_size] * b and batch.one_token_len.tolist() == [1] * b
        assert (batch.one_token_table == padding).all() and batch.idx.tolist() == [0] * b
        with torch.no_grad():  # as capture_graphs runs it: every padded row's logits
            logits = PagedEngine.forward(engine, batch)
            assert engine.forward(batch).shape == (0, model.config.vocab_size), "padding's logits were returned"
        assert logits.shape == (b, model.config.vocab_size) and torch.isfinite(logits).all()
    assert engine.kv_pool[:, :, :padding].abs().sum() == 0, "a padding row wrote outside the padding block"
