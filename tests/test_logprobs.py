"""Log-probabilities (ext/logprobs.py): each generated token's, and each prompt token's, equal log_softmax of the
model's own logits over the whole sequence (float64), whatever the engine did on the way: chunked prefill,
preemption by recompute or swap, prefix hits, speculative decoding, n samples; Hugging Face's output_logits
give the same; bad settings are refused in one line."""

import json
import random
from dataclasses import replace

import pytest
import torch
from conftest import run_engine, tiny_gpt

from ext import ServingEngine, engine_class
from harness.checkpoints import to_transformers
from scheduler import PagedEngine
from sequence import Request, SamplingParams


def full_logprobs(model, tokens):
    """log_softmax of the model's logits at every position of tokens, in one forward: (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor(tokens)[None])[0][0], -1)


def check_entry(entry, logprobs, token, width, tolerance=1e-9):
    """entry: {token: Logprob, then the width likeliest}; logprobs: (V,) the position's."""
    (own, first), *_ = entry.items()
    assert own == token and first.logprob == pytest.approx(float(logprobs[token]), abs=tolerance)
    assert first.rank == int((logprobs >= logprobs[token]).sum())  # vLLM's rank: ids as likely or likelier
    top = sorted(entry.items(), key=lambda item: item[1].rank)[:width]
    want = logprobs.topk(width)
    assert [i for i, _ in top] == want.indices.tolist() or width == 0
    assert [x.logprob for _, x in top] == pytest.approx(want.values.tolist(), abs=tolerance)
    assert len(entry) in (width, width + 1)


def check_request(model, r):
    for s in r.sequences:
        logprobs = full_logprobs(model, s.tokens)
        if r.params.logprobs is not None:
            assert len(s.logprobs) == len(s.generated)
            for i, entry in enumerate(s.logprobs):
                position = len(r.prompt) + i  # the token's; its logits are the position before's
                check_entry(entry, logprobs[position - 1], s.tokens[position], r.params.logprobs)
    if r.params.prompt_logprobs is not None:
        start = r.params.prompt_logprobs_from
        assert r.prompt_logprobs[:start] == [None] * start
        for q in range(start, len(r.prompt)):
            check_entry(r.prompt_logprobs[q], logprobs[q - 1], r.prompt[q], r.params.prompt_logprobs)


def workload(seed, n=10):
    """Prompts that share heads (prefix hits), with greedy, sampled and top-k/top-p requests, logprobs and
    prompt logprobs from various positions."""
    rng = random.Random(seed)
    heads = [[rng.randrange(300) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = rng.choice(heads) + [rng.randrange(300) for _ in range(rng.randint(1, 10))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            top_k=rng.choice([None, 20]),
            top_p=rng.choice([1.0, 0.9]),
            seed=i,
            logprobs=rng.choice([None, 0, 3]),
            prompt_logprobs=rng.choice([None, 2]),
            prompt_logprobs_from=rng.randint(1, len(prompt)),
        )
        requests.append(Request(prompt, rng.randint(1, 12), params))
    return requests


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_logprobs_equal_the_models_own_under_chunking_preemption_and_prefix_hits(model, block_size):
    """A small pool and token budget: prompts are chunked (a chunk boundary inside the scored span),
    sequences are preempted and recomputed, and heads hit the prefix cache."""
    requests = workload(block_size)
    for r in requests:  # long enough to outgrow the pool while others run: the model's context is 64
        r.max_new_tokens = min(3 * r.max_new_tokens, 64 - len(r.prompt))
    num_blocks = -(-64 // block_size)  # the longest request fits; the workload does not, at once
    engine = engine_class(logprobs=True)(model, num_blocks=num_blocks, block_size=block_size, token_budget=7)
    run_engine(engine, requests, arrivals=[0, 0, 1, 2, 2, 3, 5, 5, 6, 9], check=True)
    for r in requests:
        check_request(model, r)
    assert engine.meter.num_preemptions > 0 and engine.meter.cached_tokens > 0


def test_logprobs_hold_under_swap_speculation_and_n_samples(model):
    """Every extension at once: swapped out and back, speculating (proposals accepted and rejected), and n
    samples each with its own logprobs."""
    requests = workload(7, n=8)
    rep = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # a prompt that repeats, so that prompt lookup proposes
    requests += [
        Request(rep, 10, SamplingParams(logprobs=2)),
        Request(rep[:7], 8, SamplingParams(n=3, temperature=1.0, logprobs=1)),
    ]
    engine = ServingEngine(model, num_blocks=14, block_size=4, token_budget=9, swap_blocks=8, num_speculative_tokens=3)
    run_engine(engine, requests, check=True)
    for r in requests:
        check_request(model, r)
    assert engine.meter.swapped_out_blocks > 0 and engine.meter.proposed_tokens > 0
    assert len({tuple(s.generated) for s in requests[-1].sequences}) > 1  # the samples differ, their logprobs too


def test_a_prompt_id_past_the_engines_vocabulary(model):
    """nanoGPT pads its vocabulary: ids the engine never samples (vocab_size) may still sit in a prompt. Such a
    token's logprob is -inf and its rank counts every id; the likeliest ids' logprobs stay finite, read over the
    ids the engine samples; the entry reads as vLLM's list, as Python types, into JSON."""
    r = Request([5, 7, 9, 260, 11], 1, SamplingParams(prompt_logprobs=2))
    run_engine(engine_class(logprobs=True)(model, num_blocks=50, block_size=4, vocab_size=250), [r])
    logits = model(torch.tensor([r.prompt]))[0][0].detach()
    logits[:, 250:] = float("-inf")
    logprobs = torch.log_softmax(logits, -1)
    (own, first), *likeliest = r.prompt_logprobs[3].items()
    assert own == 260 and first == (float("-inf"), 300)
    assert [x.logprob for _, x in likeliest] == pytest.approx(logprobs[2].topk(2).values.tolist(), abs=1e-9)
    check_entry(r.prompt_logprobs[4], logprobs[3], 11, 2)
    assert r.prompt_logprobs == list(r.prompt_logprobs) and json.loads(json.dumps(list(r.prompt_logprobs)))[0] is None
    assert {type(k) for k in r.prompt_logprobs[4]} == {int}


def test_prompt_logprobs_beside_verify_steps(model):
    """A sequence speculates (a fixed k: auto would wait for the prompt) while another's prompt is scored in the
    same steps: speculation hands its verified draws on one at a time, and each prompt position is scored once."""
    rep = Request([1, 2, 3, 1, 2, 3, 1, 2], 20, SamplingParams(logprobs=1))
    scored = Request(list(range(10, 50)), 2, SamplingParams(prompt_logprobs=1))
    engine = engine_class(logprobs=True, speculative=True)(
        model, num_blocks=100, block_size=4, token_budget=16, num_speculative_tokens=2
    )
    run_engine(engine, [rep, scored], arrivals=[0, 2])
    for r in (rep, scored):
        check_request(model, r)
    assert engine.meter.proposed_tokens > 0


@pytest.mark.parametrize("token_budget", [4, 512])
def test_n_samples_with_prompt_logprobs_fork_at_the_prompts_end(model, token_budget):
    """A prompt of n samples that asks prompt logprobs, chunked or not: it forks only once its whole prompt is
    computed, so its samples draw what they draw without prompt logprobs (a chunk that ends inside the prompt
    reads logits at its last token too, to score the next)."""
    prompt = list(range(1, 21))
    params = SamplingParams(n=3, temperature=1.0, seed=5)
    scored = Request(prompt, 6, replace(params, prompt_logprobs=1))
    plain = Request(prompt, 6, params)
    forks = engine_class(forks=True, logprobs=True)
    run_engine(forks(model, num_blocks=40, block_size=4, token_budget=token_budget), [scored])
    run_engine(forks(model, num_blocks=40, block_size=4), [plain])
    assert [s.generated for s in scored.sequences] == [s.generated for s in plain.sequences]
    check_request(model, scored)


def test_logprobs_equal_log_softmax_of_hugging_faces_output_logits():
    """Greedy, on the same float64 weights: our tokens and logprobs are log_softmax of HF generate's
    output_logits at each step (which HF hands back in float32)."""
    model = tiny_gpt(seed=3)
    hf = to_transformers(model).double()
    prompt = [11, 7, 42, 9, 3]
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    r = Request(prompt, 6, SamplingParams(logprobs=4))
    run_engine(engine_class(logprobs=True)(model, num_blocks=8, block_size=4), [r])
    assert r.generated == out.sequences[0, len(prompt) :].tolist()
    for entry, logits in zip(r.sequences[0].logprobs, out.logits):
        check_entry(entry, torch.log_softmax(logits[0].double(), -1), next(iter(entry)), 4, tolerance=1e-5)


def test_rows_that_ask_nothing_run_as_before(model):
    """The extension changes no token: requests without logprobs draw what the bare core draws, beside
    requests with them."""
    requests = workload(3)
    plain = [
        Request(
            r.prompt, r.max_new_tokens, SamplingParams(**{**vars(r.params), "logprobs": None, "prompt_logprobs": None})
        )
        for r in requests
    ]
    run_engine(engine_class(logprobs=True)(model, num_blocks=60, block_size=4), requests)
    run_engine(PagedEngine(model, num_blocks=60, block_size=4), plain)
    assert [r.generated for r in requests] == [r.generated for r in plain]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logprobs=21), "logprobs 21 must be in 0..20"),
        (dict(logprobs=-1), "logprobs -1 must be in 0..20"),
        (dict(prompt_logprobs=50), "prompt_logprobs 50 must be in 0..20"),
        (dict(prompt_logprobs=1, prompt_logprobs_from=0), "prompt_logprobs_from 0 must be in 1..4"),
        (dict(prompt_logprobs=1, prompt_logprobs_from=5), "prompt_logprobs_from 5 must be in 1..4"),
        (dict(num_beams=2, logprobs=1), "beams give their scores, not logprobs"),
    ],
)
def test_bad_logprobs_settings_are_refused_in_one_line(model, params, message):
    engine = ServingEngine(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=message):
        engine.add(Request([1, 2, 3, 4], 2, SamplingParams(**params)))


def test_the_warm_up_compiles_the_scores_so_that_the_timed_run_compiles_nothing(model):
    """The command line's warm-up (harness.serving.warm_up) serves a request asking for logprobs, whose scores
    compile at their first use on a CPU: the timed run after it compiles nothing (it took ~3 s of its clock)."""
    import gc

    from torch._dynamo.utils import counters

    from harness.serving import warm_up

    try:
        warm_up(engine_class(logprobs=True)(model, num_blocks=40, block_size=4), 4)
    finally:
        gc.unfreeze()  # warm_up freezes the heap, as a served process does
    graphs = counters["stats"]["unique_graphs"]
    requests = [Request([1, 2, 3], 5, SamplingParams(logprobs=2)), Request([4, 5], 6, SamplingParams(logprobs=0))]
    run_engine(engine_class(logprobs=True)(model, num_blocks=40, block_size=4), requests)
    assert counters["stats"]["unique_graphs"] == graphs, "the run compiled"
    for r in requests:
        check_request(model, r)


def test_an_entry_asks_no_more_ids_than_the_vocabulary_holds(model):
    """An engine serving 3 of the model's ids lists at most 3: ids past them (-inf) are never listed."""
    engine = ServingEngine(model, num_blocks=8, block_size=4, vocab_size=3)
    with pytest.raises(ValueError, match=r"logprobs 5 must be in 0..3 .*the vocabulary's 3 ids"):
        engine.add(Request([1, 2], 2, SamplingParams(logprobs=5)))
    r = Request([1, 2], 2, SamplingParams(logprobs=3, prompt_logprobs=3))
    run_engine(engine, [r])
    entries = r.sequences[0].logprobs + list(r.prompt_logprobs)[1:]
    assert all(set(e) <= {0, 1, 2} and len(e) == 3 for e in entries), entries


def test_a_request_added_again_is_refused_and_keeps_its_prompt_logprobs(model):
    engine = ServingEngine(model, num_blocks=16, block_size=4)
    r = Request([1, 2, 3, 4, 5], 3, SamplingParams(prompt_logprobs=2, logprobs=1))
    run_engine(engine, [r])
    before = list(r.prompt_logprobs)
    assert before[0] is None and all(before[1:])
    with pytest.raises(ValueError, match="this request was added before"):
        engine.add(r)
    assert list(r.prompt_logprobs) == before


def test_a_listed_token_takes_its_place_as_its_rank_as_vllms_entry_does():
    """The entry's own token keeps its count rank unless it is listed among the likeliest: then, as vLLM's dict
    comprehension overwrites it, its place (the two differ only where ids tie)."""
    from ext.logprobs import Logprob, entry

    tied = entry(7, -1.0, 2, [3, 7], [-1.0, -1.0])  # ids 3 and 7 tie: 7's count rank is 2, its place 2
    assert tied == {7: Logprob(-1.0, 2), 3: Logprob(-1.0, 1)} and list(tied) == [7, 3]
    tied = entry(3, -1.0, 2, [3, 7], [-1.0, -1.0])  # 3 counts 2 ids as likely, but is listed first
    assert tied == {3: Logprob(-1.0, 1), 7: Logprob(-1.0, 2)}
    assert entry(9, -5.0, 40, [3, 7], [-1.0, -2.0])[9] == Logprob(-5.0, 40)  # not listed: its count rank


def test_the_bare_core_refuses_logprobs_in_one_line(model):
    with pytest.raises(ValueError, match=r"logprobs 1, prompt_logprobs None: this engine lacks the extension"):
        PagedEngine(model, num_blocks=8, block_size=4).add(Request([1, 2], 2, SamplingParams(logprobs=1)))


def random_requests(rng):
    """Prompts sharing heads (prefix hits), half ending in a repeated motif (prompt lookup proposes), greedy and
    sampled, n of 1 or 2, logprobs and prompt logprobs of widths 0 and 2 from any position, or none."""
    heads = [[rng.randrange(300) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(4, 12)):
        motif = [rng.randrange(300) for _ in range(3)]
        tail = (
            motif * rng.randint(1, 4) if rng.random() < 0.5 else [rng.randrange(300) for _ in range(rng.randint(1, 12))]
        )
        prompt = rng.choice(heads) + tail
        n = rng.choice([1, 1, 2])
        params = SamplingParams(
            temperature=0.9 if n > 1 else rng.choice([0.0, 0.9]),
            top_k=rng.choice([None, 20]),
            seed=i,
            n=n,
            logprobs=rng.choice([None, 0, 2]),
            prompt_logprobs=rng.choice([None, 0, 2]),
            prompt_logprobs_from=rng.randint(1, len(prompt)),
        )
        requests.append(Request(prompt, min(rng.randint(1, 16), 64 - len(prompt)), params))
    return requests


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_every_extension(model, seed):
    """Random workloads through ServingEngine with speculation (none, k = 2, 3 or auto), swap or recompute, small
    pools and budgets (chunking, preemption), block sizes 1-16 and later arrivals: every logprob equals one full
    forward's, and the tokens equal a roomy engine's that asks for no logprobs (300 seeds passed once; 8 here)."""
    rng = random.Random(seed)
    requests = random_requests(rng)
    plain = [
        Request(r.prompt, r.max_new_tokens, replace(r.params, logprobs=None, prompt_logprobs=None)) for r in requests
    ]
    block_size = rng.choice([1, 3, 4, 16])
    engine = ServingEngine(
        model,
        num_blocks=max(rng.randint(10, 40) * 4 // block_size, -(-64 // block_size) + 2),
        block_size=block_size,
        token_budget=rng.choice([5, 9, 16, 64]),
        swap_blocks=rng.choice([0, 64 // block_size]),
        num_speculative_tokens=rng.choice([0, 2, 3, "auto"]),
    )
    arrivals = sorted(rng.randint(0, 6) for _ in requests)
    run_engine(engine, requests, arrivals, check=True)
    for r in requests:
        check_request(model, r)
    run_engine(ServingEngine(model, num_blocks=400, block_size=4), plain, arrivals)
    assert [[s.generated for s in r.sequences] for r in requests] == [[s.generated for s in r.sequences] for r in plain]
