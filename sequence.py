"""What a user asks for and what runs for it: a Request holds its prompt, its SamplingParams and its times; its
Sequences hold tokens, a block table and a row of the engine's per-sequence tensors."""

from dataclasses import dataclass
from enum import Enum


@dataclass(kw_only=True)
class SamplingParams:
    """How a request's next tokens are chosen. One meaning each: temperature 0 is greedy; top_k None, top_p 1 and
    min_p 0 keep every id, and the sampler applies them in Hugging Face's order (sampling.py); eos None runs to
    max_new_tokens (as nanoGPT's sample.py). n and num_beams above 1 need the forks extension (ext/forks.py)."""

    temperature: float = 0.0
    top_k: int | None = None  # the k likeliest ids, and any tied with the k-th (as HF's and vLLM's)
    top_p: float = 1.0  # the likeliest ids while the probability before them is below top_p (as HF's and vLLM's)
    min_p: float = 0.0  # the ids at least min_p x as likely as the likeliest (as HF's and vLLM's)
    seed: int = 0  # sample i of n draws with seed + i
    n: int = 1  # samples, forked after one prefill
    num_beams: int = 1  # beam search (greedy, as transformers' num_beams)
    length_penalty: float = 1.0  # a finished beam's score is divided by (new tokens) ** this, as HF's
    eos: int | None = None  # a token that ends each sequence sampling it (as HF's eos_token_id)
    # raw log-probabilities, as vLLM's, with the logprobs extension (ext/logprobs.py): each sampled token's and its
    # N likeliest ids', and (prompt_logprobs) each prompt token's from position prompt_logprobs_from on
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1

    def best(self, vocab_size):
        """How many of the best ids hold those that top_k keeps (and top_p with it): top_k, or 0 when it keeps
        every id (a top_k of None, or of vocab_size or more)."""
        return self.top_k if (self.top_k or vocab_size) < vocab_size else 0


class RequestStatus(Enum):
    NEW = "new"  # not added to an engine yet
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class SequenceStatus(Enum):
    WAITING = "waiting"  # not admitted yet, or preempted
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    DEAD = "dead"  # a beam that no survivor continues (ext/forks.py)


class Request:
    """What a user asks for, and its sequences: one, or with the forks extension n samples in order, or
    num_beams live beams best first."""

    def __init__(self, prompt, max_new_tokens, params=None):
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.params = params or SamplingParams()
        self.status = RequestStatus.NEW
        self.sequences = [Sequence(self, prompt, self.params.seed)]

    @property
    def generated(self):  # the first sample, or the best beam
        return self.sequences[0].generated


class Sequence:
    """What runs: tokens whose K/V the engine computes, through a block table, in a row of the engine's
    per-sequence tensors."""

    def __init__(self, request, tokens, seed):
        self.request = request
        self.tokens = list(tokens)
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.row = None  # while running: its row in the engine's per-sequence tensors
        self.block_table = []  # physical block of each logical block
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_hashes = []  # chained hash of each full block of tokens, computed once each
        self.proposed = []  # tokens proposed to follow its own in this step, until verified (ext/speculative.py)

    @property
    def generated(self):
        return self.tokens[len(self.request.prompt) :]

    def num_uncomputed(self):
        return len(self.tokens) - self.num_computed

    def next_tokens(self, n):
        """Its next n tokens to compute: those not computed yet, then any proposed."""
        return (self.tokens[self.num_computed :] + self.proposed)[:n]
