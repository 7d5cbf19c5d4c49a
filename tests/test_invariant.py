"""The batch-invariant forward (ext/invariant.py), on the shipped model in float32 as bench/scoring.py runs it:
every score the same to the bit with the prefix cache on or off, at other token budgets, batch sizes and block
sizes, and alone, and in bf16; a generating request's tokens and logprobs the same alone and among others, under preemption;
its check of the kernels (fewest_rows) finds where a layer stops rounding by row count; what it cannot run on is
refused in one line. That its values are the model's, in float64, under chunking, preemption and prefix hits:
tests/test_scoring.py, with invariant=True."""

import pytest
import torch

from ext import engine_class
from ext.invariant import fewest_rows_of
from harness import scoring
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
from harness.metrics import Meter
from harness.tuning import prepare
from paged import blocks_for
from sequence import Request, SamplingParams


@pytest.fixture(scope="module")
def shipped():
    """The shipped model as generate.py and bench/scoring.py serve it (prepare: packed linears, small GELUs)."""
    return prepare(load_checkpoint(SHIPPED))


def refused(make):
    """make() -> its engine, or None where this CPU's kernels round by shape beyond what the forward pads: the
    engine refuses invariant=True in one line then, and these tests check the refusal instead."""
    try:
        return make()
    except ValueError as e:
        assert str(e).startswith("invariant=True cannot hold") and "\n" not in str(e)
        return None


def prompt_scores(engine, pairs):
    """Every scored position's logprob and rank, per pair, as arrays of the requests' own."""
    requests = [scoring.scoring_request(engine, context, continuation) for context, continuation in pairs]
    engine.run(requests)
    return [(r.prompt_logprobs.logprob.tolist(), r.prompt_logprobs.rank.tolist()) for r in requests]


@pytest.fixture(scope="module")
def pairs(shipped):
    enc = get_tokenizer(shipped.config.vocab_size)
    questions = scoring.multiple_choice(enc, 16, seed=3)
    return [
        (enc.encode_ordinary(context), enc.encode_ordinary(choice))
        for context, choices, _ in questions
        for choice in choices
    ]


@pytest.mark.parametrize(
    "settings",
    [
        dict(prefix_cache=False),
        dict(token_budget=64, max_batch=3),
        dict(token_budget=16, max_batch=2, prefix_cache=False),
        dict(token_budget=100, block_size=3),
        dict(token_budget=7, max_batch=5, block_size=1, num_blocks=700),  # a small pool: preemption
    ],
)
def test_scores_are_the_same_to_the_bit_with_the_cache_on_or_off_at_any_budget_batch_or_block_size(
    shipped, pairs, settings
):
    def engine(**kw):
        kw = {"num_blocks": 64 * blocks_for(256, kw.get("block_size", 16)), **kw}
        return refused(lambda: scoring.scoring_engine(shipped, invariant=True, **kw))

    reference = engine()
    if reference is None:
        return
    want = prompt_scores(reference, pairs)
    assert prompt_scores(engine(**settings), pairs) == want


def test_bf16_scores_are_the_same_to_the_bit_with_the_cache_on_or_off(pairs):
    model = prepare(load_checkpoint(SHIPPED).to(torch.bfloat16))

    def engine(**kw):
        return refused(lambda: scoring.scoring_engine(model, invariant=True, num_blocks=64 * 16, **kw))

    reference = engine()
    if reference is None:
        return
    want = prompt_scores(reference, pairs)
    assert prompt_scores(engine(prefix_cache=False, token_budget=64, max_batch=3), pairs) == want


def test_a_pair_scores_the_same_to_the_bit_alone_as_among_others(shipped, pairs):
    def engine():
        return refused(lambda: scoring.scoring_engine(shipped, invariant=True, num_blocks=64 * 16))

    together = engine()
    if together is None:
        return
    want = prompt_scores(together, pairs)
    assert [prompt_scores(engine(), [pair])[0] for pair in pairs[::5]] == want[::5]


SETTINGS = [  # greedy and sampled, each request's by its index
    SamplingParams(logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, seed=7),
    SamplingParams(temperature=1.0, min_p=0.05, seed=8),
]


def test_a_requests_tokens_and_logprobs_do_not_depend_on_what_runs_beside_it(shipped, pairs):
    def run(indexed_prompts, num_blocks):
        cls = engine_class(logprobs=True, invariant=True)
        engine = refused(lambda: cls(shipped, num_blocks=num_blocks, token_budget=48, invariant=True))
        if engine is None:
            return None
        meter, requests = Meter(engine), [Request(p, 24, SETTINGS[i % 3]) for i, p in indexed_prompts]
        engine.run(requests)
        return [r.generated for r in requests], [getattr(r.sequences[0], "logprobs", None) for r in requests], meter

    prompts = [context[-40 - 7 * i :] for i, (context, _) in enumerate(pairs[::4][:9])]
    together = run(list(enumerate(prompts)), num_blocks=16)  # 9 sequences of 64-120 tokens in 16 blocks: preemption
    if together is None:
        return
    tokens, logprobs, meter = together
    assert meter.num_preemptions > 0 and sum(len(x or []) for x in logprobs) == 6 * 24  # 6 of 9 ask for them
    for i in (0, 4, 8):
        alone_tokens, alone_logprobs, _ = run([(i, prompts[i])], num_blocks=64)
        assert alone_tokens == [tokens[i]] and alone_logprobs == [logprobs[i]]


def test_invariant_is_refused_in_one_line_where_it_cannot_hold(shipped):
    cls = engine_class(logprobs=True, invariant=True, compile="step")
    with pytest.raises(ValueError, match=r"^invariant=True runs on a CPU, with compile auto, on or off \(not with"):
        cls(shipped, num_blocks=64, invariant=True, compile="step")


class RoundsBelow(torch.nn.Module):
    """A row-wise layer that gives a row other values in a call of fewer than `rows` rows, or of exactly `at`."""

    def __init__(self, rows=0, at=None):
        super().__init__()
        self.rows, self.at = rows, at

    def forward(self, x):
        return x + 1e-3 if len(x) < self.rows or len(x) == self.at else x


def test_fewest_rows_finds_where_a_layer_stops_rounding_by_row_count():
    x = torch.randn(2048, 4)
    assert fewest_rows_of(RoundsBelow(), x) == 1
    assert fewest_rows_of(RoundsBelow(rows=7), x) == 7
    assert fewest_rows_of(RoundsBelow(rows=7, at=511), x) == 512  # a count that rounds apart: padded past it
    assert fewest_rows_of(RoundsBelow(at=1000), x[:1000]) is None  # every count tried rounds apart from the budget's
