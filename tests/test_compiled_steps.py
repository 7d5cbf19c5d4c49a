"""Small steps as one compiled graph on the CPU (compile="step", ext/compiled_steps.py): in float64 its tokens
equal the eager engine's, greedy, sampled, n samples and beams, under preemption by recompute and by swap, with
speculation, at block sizes 1, 3 and 16; small steps do take the graph, and one graph serves them all."""

import copy
import random

import pytest
import torch
from conftest import baseline, check_invariants, make_requests, run_engine
from hypothesis import HealthCheck, given, settings
from test_robust import run_random_workload, workloads
from test_speculative import repetitive_prompts
from test_swap import mixed_requests, outputs, storm_prompts

from ext import ServingEngine
from ext.compiled_steps import RowBatch
from harness import tuning
from harness.tuning import SmallGELU, prepare
from sequence import Request


def count_small_steps(engine):
    """Wrap make_batch so that engine.small_steps counts the steps that took the compiled graph."""
    make_batch = engine.make_batch
    engine.small_steps = 0

    def counted(plan, samplers):
        batch = make_batch(plan, samplers)
        engine.small_steps += isinstance(batch, RowBatch)
        return batch

    engine.make_batch = counted


@pytest.mark.parametrize("block_size, num_blocks", [(1, 40), (3, 16), (16, 9)])
def test_small_steps_give_the_eager_engines_tokens_under_preemption_forks_beams_and_swap(model, block_size, num_blocks):
    prompts = storm_prompts(block_size, 12, block_size)
    kw = dict(num_blocks=num_blocks, block_size=block_size, token_budget=24, max_batch=8)
    for swap_blocks in [0, 4 * num_blocks]:
        eager = mixed_requests(prompts)
        run_engine(ServingEngine(model, swap_blocks=swap_blocks, **kw), eager)
        compiled = mixed_requests(prompts)
        engine = ServingEngine(model, swap_blocks=swap_blocks, compile="step", **kw)
        count_small_steps(engine)
        run_engine(engine, compiled, check=True)
        assert outputs(compiled) == outputs(eager)
        assert engine.meter.num_preemptions > 0 and engine.small_steps > 20
        assert engine.allocator.num_free() == num_blocks


@pytest.mark.parametrize("k", [1, 4])
def test_compiled_verify_steps_give_plain_decodings_tokens(model, k):
    prompts = repetitive_prompts(8, k)
    news = [random.Random(i).randint(1, 30) for i in range(8)]
    for temperature, top_k in [(0.0, None), (0.05, 40)]:
        want = baseline(model, prompts, news, temperature, top_k)
        engine = ServingEngine(model, num_blocks=200, block_size=4, num_speculative_tokens=k, compile="step")
        count_small_steps(engine)
        assert run_engine(engine, make_requests(prompts, news, temperature, top_k), check=True) == want
        proposed = sum(stats[0] for stats in engine.meter.speculation.values())
        assert proposed > 0 and engine.small_steps > 10


def test_one_graph_serves_every_small_step(model, monkeypatch):
    """Rows, tokens per row, samplers, blocks and the pool's size all change between steps and engines; none
    of them compiles a second graph (the sizes are padded to 2 and kept apart: see graph_settings). The model
    goes through prepare, as generate.py's does: a SmallGELU chooses its kernel by size outside a compiled graph
    only, so that no guard on a step's size enters the graph."""
    model = prepare(copy.deepcopy(model))
    assert any(isinstance(m, SmallGELU) for m in model.modules())
    monkeypatch.setattr(tuning, "SMALL_GELU", 1024)  # 8 tokens of this model's MLP: small steps fall either side
    run_engine(ServingEngine(model, num_blocks=50, block_size=4, compile="step"), [Request([1, 2], 3)])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    prompts = repetitive_prompts(6, 3)
    for num_blocks, block_size, k in [(120, 4, 4), (300, 1, 2), (40, 16, 0)]:
        engine = ServingEngine(
            model, num_blocks=num_blocks, block_size=block_size, num_speculative_tokens=k, compile="step"
        )
        run_engine(engine, [Request(p, 12) for p in prompts], arrivals=[0, 0, 3, 5, 9, 9], check=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(w=workloads())
def test_random_workloads_with_compiled_small_steps_match_the_baseline(model, w):
    engine = run_random_workload(model, w, ServingEngine, compile="step", num_speculative_tokens="auto")
    check_invariants(engine)
    assert engine.allocator.num_free() == w["num_blocks"]


def test_step_is_refused_off_the_cpu(model):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(ValueError, match="compile 'step' compiles small steps on a CPU"):
        ServingEngine(copy.deepcopy(model).cuda(), num_blocks=10, compile="step")


def test_a_prompt_sharing_a_prefix_computed_in_the_same_step_runs_eagerly_with_the_eager_tokens(model):
    """Two prompts with one prefix admitted in one step: the second shares the first's blocks as they are
    computed (PagedEngine.schedule). The graph reads the pool before the step's K/V are written, so that step
    runs as the core runs it; the tokens are the eager engine's."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 1], [5, 6, 7, 8, 9, 10, 11, 12, 2]]
    want = run_engine(ServingEngine(model, num_blocks=20, block_size=4), make_requests(prompts, [4, 4]))
    engine = ServingEngine(model, num_blocks=20, block_size=4, compile="step")
    rows = []
    make_batch = engine.make_batch
    engine.make_batch = lambda plan, samplers: rows.append(make_batch(plan, samplers)) or rows[-1]
    assert run_engine(engine, make_requests(prompts, [4, 4]), check=True) == want
    assert engine.meter.cached_tokens == 8 and not isinstance(rows[0], RowBatch)  # shared in the first step
    assert any(isinstance(batch, RowBatch) for batch in rows[1:])  # the decode steps ran in the graph
