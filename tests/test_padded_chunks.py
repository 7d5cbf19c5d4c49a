"""Short chunks after cached K/V attend together, padded (ext/padded_chunks.py): the tokens equal the bare core's,
which attends each chunk alone, and the contiguous baseline's, under prefix hits, chunking and preemption; the
chunks' prompt logprobs equal the model's own. The CUDA extension's pad_chunks=True pads every chunk of a step,
prompts from their start too: the same tokens, with forks, beams and preemption."""

import copy
import random

import numpy as np
import pytest
import torch
from conftest import baseline, check_invariants, make_requests, run_engine
from test_decode_graphs import mixed_requests
from test_logprobs import check_request

from batch import Chunk
from engine import PlanEntry, Sampler
from ext import ServingEngine, engine_class
from ext.cuda import StagedBatch
from ext.padded_chunks import SHORT, PaddedChunks, few_padding, fresh_runs, padded_batch_class
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, SamplingParams


class CountPadded:
    """An engine mixin that counts the steps whose batch attends two or more chunks padded, the chunks, and those
    padded from their prompt's start."""

    def make_batch(self, plan, samplers):
        batch = super().make_batch(plan, samplers)
        if len(getattr(batch, "padded", [])) > 1:
            self.padded_steps = getattr(self, "padded_steps", 0) + 1
            self.padded_chunks = getattr(self, "padded_chunks", 0) + len(batch.padded)
            fresh = sum(batch.chunks[i].num_cached == 0 for i in batch.padded)  # prompts from their start
            self.padded_fresh = getattr(self, "padded_fresh", 0) + fresh
        return batch


def shared_heads(seed, n=16):
    """Prompts that share heads and end in 1 to SHORT + 4 tokens of their own: a request after its head is cached
    prefills only its own tail, a short chunk (or a long one, past SHORT) after cached K/V; 64 tokens at most.
    -> prompts, max_new_tokens, each prompt's head length."""
    rng = random.Random(seed)
    heads = [[rng.randrange(300) for _ in range(size)] for size in (8, 16, 20)]
    chosen = [rng.choice(heads) for _ in range(n)]
    prompts = [head + [rng.randrange(300) for _ in range(rng.randint(1, SHORT + 4))] for head in chosen]
    return prompts, [rng.randint(1, 64 - len(p)) for p in prompts], [len(head) for head in chosen]


@pytest.mark.parametrize("block_size,token_budget", [(1, 64), (4, 48), (16, 512)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_chunks_give_the_cores_tokens(model, block_size, token_budget, temperature):
    prompts, news, _ = shared_heads(block_size)
    padded = type("Padded", (CountPadded, engine_class(logprobs=True)), {})
    plain = PagedEngine(model, num_blocks=400, block_size=block_size, token_budget=token_budget)
    engine = padded(model, num_blocks=400, block_size=block_size, token_budget=token_budget)
    for e in (plain, engine):  # the heads' prompts first, so that later requests find their heads cached
        run_engine(e, make_requests(prompts[:3], news[:3], temperature))
    got = run_engine(engine, make_requests(prompts, news, temperature))
    assert got == run_engine(plain, make_requests(prompts, news, temperature))
    assert engine.padded_steps > 0 and engine.meter.cached_tokens > 0


def test_padded_chunks_under_preemption_equal_the_contiguous_baseline(model):
    """A pool too small for the workload: sequences are preempted and recompute their prompts, whose tails come
    back as short chunks after their cached heads."""
    prompts, news, _ = shared_heads(7, n=12)
    padded = type("Padded", (CountPadded, engine_class(logprobs=True)), {})
    engine = padded(model, num_blocks=40, block_size=4, token_budget=40)
    got = run_engine(engine, make_requests(prompts, news), check=True)
    check_invariants(engine)
    assert got == baseline(model, prompts, news)
    assert engine.meter.num_preemptions > 0 and engine.padded_steps > 0


def test_padded_chunks_give_the_models_own_logprobs(model):
    """Every token of a padded chunk: the prompt logprobs of each tail (scored from its first token on, so that
    its head stays cached) and each generated token's logprobs equal log_softmax of one full forward (float64)."""
    prompts, news, heads = shared_heads(3)
    padded = type("Padded", (CountPadded, engine_class(logprobs=True)), {})
    engine = padded(model, num_blocks=400, block_size=4, token_budget=64)
    run_engine(engine, make_requests(prompts[:3], news[:3]))  # the heads go first: the tails find them cached
    requests = [
        Request(p, n, SamplingParams(logprobs=2, prompt_logprobs=1, prompt_logprobs_from=head))
        for p, n, head in zip(prompts, news, heads)
    ]
    run_engine(engine, requests)
    for r in requests:
        check_request(model, r)
    assert engine.padded_steps > 0 and engine.meter.cached_tokens > 0


def test_a_lone_chunk_reads_its_blocks_in_place_and_gives_the_cores_tokens_and_the_models_logprobs(model):
    """A step whose one short chunk is its sequence's alone (a speculating sequence's verify rows at batch 1, a
    scored prompt's chunk after its first) attends over its own slots in the pool, in place and unpadded, where its
    blocks follow each other; where they do not (two sequences grew side by side, then one finished) it goes
    through the padded call. Greedy speculation gives plain decoding's tokens both ways, and the scored prompts
    the model's own logprobs (float64)."""
    steps = []

    class Recording:
        def make_batch(self, plan, samplers):
            batch = super().make_batch(plan, samplers)
            if len(getattr(batch, "padded", [])) == 1:
                steps.append(batch.lone_slots is not None)
            return batch

    rng = random.Random(4)
    prompts = [[rng.randrange(300) for _ in range(6)] * 3 for _ in range(3)]  # repeats: proposals get accepted
    news = [24, 10, 30]
    speculating = type("Speculating", (Recording, engine_class(speculative=True)), {})
    for max_batch in (1, 2):
        engine = speculating(model, num_blocks=80, block_size=2, max_batch=max_batch, num_speculative_tokens=3)
        assert run_engine(engine, make_requests(prompts, news), check=True) == baseline(model, prompts, news)
        assert engine.meter.accepted_tokens > 0
    assert True in steps and False in steps
    steps.clear()
    scoring = type("Scoring", (Recording, engine_class(logprobs=True)), {})
    engine = scoring(model, num_blocks=80, block_size=4, max_batch=1, token_budget=8)  # prompts in chunks of 8
    requests = [Request(p, n, SamplingParams(logprobs=2, prompt_logprobs=1)) for p, n in zip(prompts, news)]
    run_engine(engine, requests)
    for r in requests:
        check_request(model, r)
    assert True in steps


def test_fresh_runs_group_side_by_side_prompts_of_one_length_from_their_start():
    def chunk(start, length, num_cached=0):
        return Chunk(0, start, start + length, num_cached)

    chunks = [chunk(0, 8), chunk(8, 8), chunk(16, 8), chunk(24, 5), chunk(29, 8, 3), chunk(37, 8), chunk(45, 8)]
    assert fresh_runs(chunks, skip=set()) == [(0, 3, 8), (5, 2, 8)]  # a cached chunk parts the 8s
    assert fresh_runs(chunks, skip={1}) == [(5, 2, 8)]  # a padded chunk attends with the padded ones
    assert fresh_runs(chunks[3:5], skip=set()) == []


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_fresh_runs_give_the_models_own_logprobs_and_the_cores_tokens(model, block_size):
    """Windows of one length scored from their second token, as loglikelihood_rolling asks, several a step: each
    run of them attends in one call, and every prompt logprob equals log_softmax of one full forward (float64);
    sampled tokens equal the bare core's, which attends each prompt alone."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(300) for _ in range(24)] for _ in range(9)] + [[5, 6, 7]] * 2

    class CountRuns:
        def make_batch(self, plan, samplers):
            batch = super().make_batch(plan, samplers)
            self.in_runs = getattr(self, "in_runs", 0) + sum(count for _, count, _ in batch.runs)
            return batch

    scoring = type("Scoring", (CountRuns, engine_class(logprobs=True)), {})
    engine = scoring(model, num_blocks=300, block_size=block_size, token_budget=100)
    requests = [
        Request(p, 4, SamplingParams(temperature=1.0, seed=i, prompt_logprobs=2)) for i, p in enumerate(prompts)
    ]
    run_engine(engine, requests)
    for r in requests:
        check_request(model, r)
    plain = PagedEngine(model, num_blocks=300, block_size=block_size, token_budget=100)
    want = run_engine(plain, [Request(p, 4, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)])
    assert [r.generated for r in requests] == want
    assert engine.in_runs >= 6


def test_padded_batch_class_is_composed_once(model):
    """Speculation and logprobs both ask for it: the batch class takes the mixin once."""
    engine = engine_class(logprobs=True, speculative=True)(model, num_blocks=8)
    assert engine.batch_class.__mro__.count(PaddedChunks) == 1
    assert padded_batch_class(engine.batch_class) is engine.batch_class
    # asked for every chunk after short ones only (or before), in either order: every chunk, the mixin once
    for every in (padded_batch_class(engine.batch_class, every_chunk=True), padded_batch_class(StagedBatch, True)):
        assert every.every_chunk and every.__mro__.count(PaddedChunks) == 1
        assert padded_batch_class(every) is every


def test_padded_chunks_stage_on_the_gpus_one_copy_path():
    """On CUDA the batch stages its host arrays in one copy (ext/cuda.py's StagedBatch), its table already on
    the device: the padded chunks' tables are cut from it there. The meta device stands in for CUDA, as CI has
    none: building the batch must not mix devices in one copy."""
    s = Request(list(range(1, 13)), 2).sequences[0]
    s.num_computed, s.row, s.block_table = 8, 0, [0, 1, 2]  # 8 cached tokens, then a chunk of 4
    block_tables = np.zeros((4, 8), dtype=np.int32)  # the engine's, a host array
    block_tables[0, :3] = [0, 1, 2]
    kv_pool = torch.zeros(2, 2, 11, 4, 2, 16, device="meta")  # (K and V, layers, blocks + 1, block_size, H, D)
    batch_class = padded_batch_class(StagedBatch)
    batch = batch_class([PlanEntry(s, 4)], [Sampler(s, 0)], torch.device("meta"), kv_pool, block_tables, False)
    assert batch.padded == [0] and batch.padded_table.device.type == "meta"
    assert batch.padded_table.shape == (1, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["off", "graph"])
def test_padded_chunks_on_cuda_give_the_cpu_cores_tokens_and_logprobs(model, compile):
    """On a GPU, through one-copy staging with compile="graph" (ext/cuda.py's StagedBatch): the same tokens as
    the bare core on the CPU, and each padded chunk's prompt logprobs equal to one full forward's."""
    cuda_model = copy.deepcopy(model).cuda()
    prompts, news, heads = shared_heads(5)
    plain = PagedEngine(model, num_blocks=400, block_size=4, token_budget=48)
    padded = type("Padded", (CountPadded, engine_class(logprobs=True, compile=compile)), {})
    engine = padded(cuda_model, num_blocks=400, block_size=4, token_budget=48, compile=compile)
    for e in (plain, engine):  # the heads' prompts first, so that later requests find their heads cached
        run_engine(e, make_requests(prompts[:3], news[:3]))
    requests = [
        Request(p, n, SamplingParams(prompt_logprobs=1, prompt_logprobs_from=head, seed=1000 + i))
        for i, (p, n, head) in enumerate(zip(prompts, news, heads))
    ]
    run_engine(engine, requests)
    assert [r.generated for r in requests] == run_engine(plain, make_requests(prompts, news))
    for r in requests:
        check_request(model, r)
    assert engine.padded_steps > 0


def test_few_padding_bounds_the_padded_rows_by_twice_the_real_ones():
    chunk = lambda n: Chunk(0, 0, n, 0)
    assert few_padding([chunk(8), chunk(8), chunk(2)])  # 3 x 8 rows for 18 real: at most 36
    assert not few_padding([chunk(64), chunk(2), chunk(2)])  # 3 x 64 for 68
    assert few_padding([])


@pytest.mark.parametrize("block_size,token_budget", [(1, 40), (4, 64), (16, 512)])
@pytest.mark.parametrize("compile", ["off", "graph"])
def test_every_chunk_padded_gives_the_cores_tokens_with_forks_beams_and_preemption(
    model, block_size, token_budget, compile
):
    """pad_chunks=True: a step's prompt chunks, from their start or after cached K/V, attend in one padded call
    where padding at most doubles their rows. Greedy requests, samples and beams, prompts of 1-40 tokens in
    chunks, a pool that preempts: the bare core's tokens (which attends each chunk alone), in float64."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 40))] for _ in range(9)]
    num_blocks = 3 * blocks_for(40 + 12, block_size) + 4  # a beam group of the longest prompt, and 4 more
    outputs = {}
    for pad_chunks in (False, True):
        cls = type("Counted", (CountPadded, ServingEngine), {})  # the CUDA extension's switch, any compile mode
        sizes = dict(num_blocks=num_blocks, block_size=block_size, token_budget=token_budget, max_batch=12)
        engine = cls(model, **sizes, compile=compile, pad_chunks=pad_chunks)
        requests = mixed_requests(prompts)
        run_engine(engine, requests, check=True)
        outputs[pad_chunks] = [[s.generated for s in r.sequences] for r in requests]
        assert engine.meter.num_preemptions > 0
        assert (getattr(engine, "padded_fresh", 0) > 0) == pad_chunks
    assert outputs[True] == outputs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_chunk_padded_on_cuda_gives_the_cpu_cores_tokens(model):
    """pad_chunks=True on a GPU with captured decode steps: samples, beams and preemption give the tokens of
    the bare core on the CPU (float64 both)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 40))] for _ in range(9)]
    sizes = dict(num_blocks=3 * blocks_for(40 + 12, 16) + 4, block_size=16, token_budget=64, max_batch=12)
    want = ServingEngine(model, **sizes)
    engine = type("Counted", (CountPadded, ServingEngine), {})(
        copy.deepcopy(model).cuda(), **sizes, compile="graph", pad_chunks=True
    )
    outputs = []
    for e in (want, engine):
        requests = mixed_requests(prompts)
        run_engine(e, requests, check=True)
        outputs.append([[s.generated for s in r.sequences] for r in requests])
    assert outputs[0] == outputs[1]
    assert engine.padded_fresh > 0 and engine.meter.num_preemptions > 0
