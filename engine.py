"""The engine that serves requests (sequence.py) in steps of one forward: plan -> batch -> forward -> sample ->
bookkeeping. A subclass decides what runs (schedule) and where K/V live (make_batch, release): PagedEngine
(scheduler.py), or the contiguous baseline (harness/contiguous.py). Extensions (ext/) subclass an engine and
override the methods that name them; the core imports none of them.

The seams, each: who calls it -> who overrides it (ext/ unless named).
    add(r)                  the user -> forks (a beam request's first Beam), logprobs (its PromptLogprobs)
    check_extensions(r, p)  check -> forks (n, num_beams), logprobs (logprobs, prompt_logprobs); the core refuses
    schedule()              step -> PagedEngine, ContiguousEngine
      schedule_decodes()    PagedEngine.schedule -> speculative (proposals after each next token)
      reserve_slot(s)       schedule_decodes -> forks (copy a shared last block on write)
      preempt(s)            make_room -> forks (a beam group whole); save_kv(s): preempt -> swap
      admit_next()          schedule -> forks (a preempted beam group whole); admit(s, blocks): -> swap
      cacheable(s)          admit_next -> logprobs (prompt logprobs: no cached block past the first scored token)
      can_admit(s, cached)  admit_next -> forks (rows and block copies for n samples)
      blocks_needed(r)      PagedEngine.check -> forks (a block set a beam)
    samplers(plan)          step -> forks (a prompt's n samples), speculative (each proposal), logprobs (prompt)
    make_batch(plan, ...)   step -> PagedEngine (batch_class: cuda's staging, padded_chunks' short chunks, cpu_kernel's
                            decode attention), cuda (a padded decode step), compiled_steps (a small step's rows),
                            ContiguousEngine
    forward(batch)          step -> cuda (replays a captured graph), compiled_steps (its compiled graph); a padded
                            batch's forward returns one logits row per sampler
    mark_computed(plan)     step -> PagedEngine (the prefix cache), forks (forks take their parent's blocks),
                            speculative (only verified tokens count)
    sample(logits, ...)     step -> forks (a beam's log-probabilities), logprobs (the asked-for entries),
                            cpu_kernel (every row's draw in C)
    append_tokens(...)      step -> forks (beams step as a group), speculative (verify, roll back), logprobs
    finish(r)               append_tokens, and forks once a beam group's hypotheses are its sequences
    release(s)              stop -> PagedEngine, ContiguousEngine, speculative
    notify(event, ...)      the engine -> its observers (harness/observer.py)
Beside them: a batch's stage (cuda: one copy) and attend_chunks (padded_chunks, for speculative and logprobs),
Sequence.proposed (speculative), Sampler.back (speculative, logprobs), PagedEngine.compile_modes (cuda: graph;
compiled_steps: step; cpu_kernel: kernel), and the block arithmetic extensions call: place_blocks, blocks_to_admit,
spare_blocks."""

import math
from collections import deque
from typing import NamedTuple

import torch

from sampling import UINT32, sample
from sequence import RequestStatus, Sequence, SequenceStatus


class PlanEntry(NamedTuple):
    """A sequence's part of a step: its next num_tokens tokens go through the forward."""

    sequence: Sequence
    num_tokens: int


class Sampler(NamedTuple):
    """A sequence whose next token this step draws, from the logits of plan entry `entry`'s last token, or of the
    token `back` before it (speculative decoding draws at each of an entry's tokens: ext/speculative.py)."""

    sequence: Sequence
    entry: int
    back: int = 0


class Engine:
    """Runs requests to completion. Subclasses choose each step's tokens (schedule) and keep K/V (make_batch,
    release). Observers (harness/observer.py) hear what happened at each step; the engine keeps no measurements."""

    def __init__(self, model, *, max_batch=64, vocab_size=None):
        self.model = model
        self.max_batch = max_batch  # sequences at once
        self.window = model.config.block_size  # the model's context (nanoGPT's name), not a KV block's size
        # ids from vocab_size on are never sampled: nanoGPT pads GPT-2's 50,257 tokens to 50,304 ids
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = model.lm_head.weight.device
        self.observers = []
        self.waiting = deque()  # sequences
        self.running = []  # sequences, in the order they started
        # each running sequence holds a row of settings (sampling.sample's), so a step reads them without copying
        self.free_rows = list(reversed(range(max_batch)))
        self.settings = torch.zeros(max_batch, 5, dtype=torch.float64, device=self.device)

    def notify(self, event, *args):  # each observer has a method for every event (harness/observer.py)
        for observer in self.observers:
            getattr(observer, event)(*args)

    def add(self, r):
        """Queue a request, or refuse it in one line."""
        if r.status is not RequestStatus.NEW:
            raise ValueError(f"this request was added before (it is {r.status.value}); a request runs once")
        self.check(r)
        r.status = RequestStatus.WAITING
        self.waiting.append(r.sequences[0])
        self.notify("added", r)

    def check(self, r):
        total = len(r.prompt) + r.max_new_tokens
        num_ids = self.model.config.vocab_size  # a prompt's ids index the embedding's rows; else the step fails for all
        if not r.prompt or min(r.prompt) < 0 or max(r.prompt) >= num_ids:
            raise ValueError(f"empty prompt, or an id outside the model's 0..{num_ids - 1}: {r.prompt[:8]}")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {r.max_new_tokens}; it must be at least 1")
        if total - 1 > self.window:  # the last new token is never fed back, so it needs no position
            why = f"prompt of {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens} = {total}"
            raise ValueError(f"{why} exceeds the model's context of {self.window} (+1: the last is never fed back)")
        p = r.params
        if not 0 <= p.temperature < math.inf or p.top_k is not None and p.top_k < 1:  # NaN too
            raise ValueError(f"temperature {p.temperature} must be a finite number >= 0 and top_k {p.top_k} >= 1")
        # the sampler reads top_p in float32: below 1e-38 it loses precision there, below ~7e-46 it is 0
        if not (1e-38 <= p.top_p <= 1 and 0 <= p.min_p <= 1):
            raise ValueError(f"top_p {p.top_p} must be in [1e-38, 1] and min_p {p.min_p} in [0, 1]")
        self.check_extensions(r, p)

    def check_extensions(self, r, p):
        """Refuse what p asks of an extension: n samples and beams (ext/forks.py), logprobs (ext/logprobs.py).
        Each extension checks its own settings, then calls this with them at their defaults."""
        if (p.n, p.num_beams, p.logprobs, p.prompt_logprobs) != (1, 1, None, None):
            why = f"n {p.n}, num_beams {p.num_beams}, logprobs {p.logprobs}, prompt_logprobs {p.prompt_logprobs}"
            raise ValueError(f"{why}: this engine lacks the extension (n, num_beams: ext/forks.py; ext/logprobs.py)")

    def run(self, requests):
        for r in requests:
            self.add(r)
        while self.waiting or self.running:
            self.step()

    @torch.inference_mode()  # no autograd bookkeeping at all: ~10% of a batch-1 step (docs/vllm.md)
    def step(self):
        """One forward: plan -> batch -> forward -> sample -> bookkeeping."""
        plan = self.schedule()
        if not plan:  # admission always lets something run; never spin
            raise RuntimeError(f"no progress: {len(self.waiting)} waiting, {len(self.running)} running")
        self.notify("planned", plan)
        samplers = self.samplers(plan)
        batch = self.make_batch(plan, samplers)
        logits = self.forward(batch)  # (S, V)
        self.mark_computed(plan)
        # at least float32, as vLLM's (float64 stays for greedy rows; draws are float32); ids past the
        # vocabulary never win
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.vocab_size :] = float("-inf")
        tokens = self.sample(logits, batch, samplers).tolist()  # the step's one transfer to the host
        self.notify("sampled", plan)
        self.append_tokens(samplers, tokens)
        self.notify("stepped")

    def forward(self, batch):  # the CUDA extension replays a captured graph here (ext/cuda.py)
        return self.model(batch.idx, batch=batch)[0]

    def samplers(self, plan):
        """A sampler for each sequence whose last tokens go through the forward (its next token is due); the
        forks extension adds a prompt's other samples here."""
        return [Sampler(s, i) for i, (s, n) in enumerate(plan) if n == s.num_uncomputed()]

    def start(self, s):
        s.row = self.free_rows.pop()
        s.request.status = RequestStatus.RUNNING
        # the one place a sequence's settings take their device form: its top_k, how many best ids it keeps
        p = s.request.params
        settings = [p.temperature, p.best(self.vocab_size), p.top_p, p.min_p, s.seed & UINT32]  # sampling.sample's
        self.settings[s.row] = torch.tensor(settings)
        s.status = SequenceStatus.PREFILLING
        self.running.append(s)

    def mark_computed(self, plan):
        """The plan's new K/V are in the cache."""
        for s, n in plan:
            s.num_computed += n

    def sample(self, logits, batch, samplers):
        """A token for every sampler, drawn on the device from its row's settings: (S,), left on the device."""
        best = [s.request.params.best(self.vocab_size) for s, *_ in samplers if s.request.params.temperature > 0]
        return sample(logits, self.settings[batch.sample_rows], batch.sample_pos, max(best, default=0), 0 in best)

    def append_tokens(self, samplers, tokens):
        """Each token joins its sequence, which decodes from now on, done at max_new_tokens or eos; the request is
        done when all its sequences are."""
        for (s, _, _), token in zip(samplers, tokens):
            r = s.request
            s.status = SequenceStatus.DECODING
            s.tokens.append(token)
            if len(s.tokens) - len(r.prompt) == r.max_new_tokens or token == r.params.eos:  # blocks free at once
                self.stop(s, SequenceStatus.DONE)
                if all(x.status is SequenceStatus.DONE for x in r.sequences):
                    self.finish(r)

    def finish(self, r):  # all its sequences done (ext/forks.py: its beams)
        r.status = RequestStatus.DONE

    def stop(self, s, status):  # done, preempted, or a beam that died (ext/forks.py)
        s.status = status
        self.running.remove(s)
        self.free_rows.append(s.row)
        self.release(s)
        s.row = None
