"""Beam search that stops at end of text (ext/forks.py), as Hugging Face's generate(num_beams=k, eos_token_id,
length_penalty, early_stopping): ended beams are kept as hypotheses, scored by their sum over (new tokens) **
length_penalty, and the best k come back best first, each with its score; a beam that ends holds no block."""

import itertools

import pytest
import torch
from conftest import check_invariants, run_engine, tiny_gpt

from ext import engine_class
from harness.checkpoints import to_transformers
from sequence import Request, SamplingParams

EOS = 7  # of a 40-id vocabulary: random models end often


def hf_beams(hf, prompt, k, early_stopping, length_penalty, max_new_tokens):
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=k,
        num_return_sequences=k,
        eos_token_id=EOS,
        pad_token_id=0,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequences = [seq[len(prompt) :].tolist() for seq in out.sequences]
    sequences = [s[: s.index(EOS) + 1] if EOS in s else s for s in sequences]  # HF pads after eos
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("num_blocks", [64, 13])  # roomy, and a pool that preempts beam groups (4 beams: 12)
def test_beams_with_eos_equal_hugging_faces_for_every_early_stopping_and_length_penalty(num_blocks):
    ended = preemptions = 0
    for seed in range(3):
        model = tiny_gpt(seed=seed, vocab_size=40, dtype=torch.float32)
        hf = to_transformers(model)
        for k, early_stopping, length_penalty in itertools.product([2, 4], [False, True, "never"], [0.5, 1.0, 2.0]):
            prompts = [[1 + seed, 5, 9, 2], [3, 3, 8 + seed, 1, 6]]
            engine = engine_class(forks=True)(model, num_blocks=num_blocks, block_size=4, early_stopping=early_stopping)
            params = SamplingParams(num_beams=k, eos=EOS, length_penalty=length_penalty)
            requests = [Request(p, 8, params) for p in prompts]
            run_engine(engine, requests, check=True)
            for p, r in zip(prompts, requests):
                sequences, scores = hf_beams(hf, p, k, early_stopping, length_penalty, 8)
                assert [s.generated for s in r.sequences] == sequences
                assert [s.score for s in r.sequences] == pytest.approx(scores, abs=1e-5)
                ended += sum(s.generated[-1] == EOS for s in r.sequences)
            check_invariants(engine)
            preemptions += engine.meter.num_preemptions
            assert engine.allocator.num_free() == num_blocks and not engine.hypotheses  # nothing held, nothing kept
    assert ended >= 5  # hypotheses that ended at eos, not only at max_new_tokens
    assert (preemptions > 0) == (num_blocks == 13)


def test_beams_that_reach_max_new_tokens_score_as_before(model):
    """Without an eos, every beam runs to max_new_tokens and is scored over it, best first."""
    r = Request([1, 2, 3], 6, SamplingParams(num_beams=3, length_penalty=1.5))
    run_engine(engine_class(forks=True)(model, num_blocks=20, block_size=4), [r])
    assert all(len(s.generated) == 6 for s in r.sequences)
    assert [s.score for s in r.sequences] == sorted((s.score for s in r.sequences), reverse=True)


def test_bad_early_stopping_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match="early_stopping 'always' must be False, True or 'never'"):
        engine_class(forks=True)(model, num_blocks=8, block_size=4, early_stopping="always")
