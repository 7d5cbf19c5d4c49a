"""Requests, the sequences that run for them, and the engine that serves them in steps of one forward:
plan -> batch -> forward -> sample -> bookkeeping. A subclass decides what runs (schedule) and where K/V
live (make_batch, fork_kv, release): PagedEngine (scheduler.py) and ContiguousEngine (contiguous.py)."""

import ctypes
import math
import sys
import time
from collections import deque
from enum import Enum
from types import SimpleNamespace
from typing import NamedTuple

import torch

from sampling import sample as sample_tokens


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class SequenceStatus(Enum):
    WAITING = "waiting"  # not admitted yet, or preempted: its K/V are recomputed when admitted
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    DEAD = "dead"  # a beam that no survivor continues


class Request:
    """What a user asks for, its times, and its sequences: one until its prompt is computed, then n samples
    in order, or num_beams live beams best first."""

    def __init__(
        self, prompt, max_new_tokens, temperature=0, top_k=None, seed=0, n=1, num_beams=1, length_penalty=1.0, eos=None
    ):
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed  # sample i of n draws with seed + i
        self.n = n
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.eos = eos  # a token that ends each sequence sampling it (as HF's eos_token_id); None: only max_new_tokens
        self.status = RequestStatus.WAITING
        self.arrival = self.first_token_at = self.done_at = None  # clock times
        self.width = max(n, num_beams)  # the sequences it runs at once
        self.sequences = [Sequence(self, prompt, seed)]

    @property
    def generated(self):  # the first sample, or the best beam
        return self.sequences[0].generated


class Sequence:
    """What runs: tokens whose K/V the engine computes, through a block table, in a row of the engine's
    per-sequence tensors. A fork starts from its parent's tokens, score and K/V; its seed: seed + i for the
    n samples, its parent's for a beam."""

    def __init__(self, request, tokens, seed):
        self.request = request
        self.tokens = list(tokens)
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.row = None  # while running: its row in the engine's per-sequence tensors
        self.block_table = []  # physical block of each logical block
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_hashes = []  # chained hash of each full block of tokens, computed once each
        self.score = 0.0  # a beam's summed log-probability
        self.logprobs = None  # a beam's next-token log-probabilities, held until every beam of its group has its own

    @property
    def generated(self):
        return self.tokens[len(self.request.prompt) :]

    def num_rows(self):  # rows admission finds for it: before its prompt forks, every sequence its request runs
        return 1 if len(self.request.sequences) > 1 else self.request.width  # forks never fall back to one

    def num_uncomputed(self):
        return len(self.tokens) - self.num_computed


class PlanEntry(NamedTuple):
    """A sequence's part of a step: its next num_tokens tokens go through the forward."""

    sequence: Sequence
    num_tokens: int


class Sampler(NamedTuple):
    """A sequence whose next token this step draws, from the logits of plan entry `entry`'s last token."""

    sequence: Sequence
    entry: int


class Observer:
    """What an engine tells its observers (metrics.Meter, plots.PoolMap). A step's schedule() admits,
    preempts and copies on write; then come planned, sampled and stepped. A subclass overrides what it needs;
    the engine itself keeps no measurements."""

    def planned(self, plan):  # the step's plan, before the forward
        pass

    def sampled(self, plan):  # the step's tokens are on the host
        pass

    def stepped(self):  # the step's bookkeeping is done
        pass

    def admitted(self, group):  # sequences admitted to run, each with num_computed cached tokens
        pass

    def preempted(self, sequence):  # a sequence let go of its blocks, to be recomputed
        pass

    def copied(self, block):  # a block copied on write, now held by the sequence that writes it
        pass


WALL_CLOCK = SimpleNamespace(now=time.perf_counter, sleep=time.sleep)  # the harness sleeps; tests swap in fakes


def keep_freed_memory():
    """On Linux, memory a step frees stays in the process, for the next step's activations of the same sizes:
    by default glibc unmaps large blocks on free, and every step page-faults them back in (docs/vllm.md).
    It sets the whole process's allocator; elsewhere it does nothing."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        libc.mallopt(-4, 0)  # M_MMAP_MAX: large blocks come from the heap, not from mmap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GiB of the heap's free top is kept


class Engine:
    """Runs requests to completion. Subclasses choose each step's tokens (schedule) and keep K/V (make_batch,
    fork_kv, release)."""

    def __init__(self, model, max_batch=64, vocab_size=None, clock=None):
        if max_batch < 1:
            raise ValueError(f"max_batch is {max_batch}; it must be at least 1")
        self.model = model
        self.max_batch = max_batch
        self.max_running = max_batch  # sequences at once
        self.window = model.config.block_size  # the model's context (nanoGPT's name), not a KV block's size
        # ids from vocab_size on are never sampled: nanoGPT pads GPT-2's 50,257 tokens to 50,304 ids
        self.vocab_size = vocab_size or model.config.vocab_size
        self.num_ids = model.config.vocab_size  # a prompt's ids index the embedding's rows
        self.device = model.lm_head.weight.device
        self.clock = clock or WALL_CLOCK
        keep_freed_memory()
        # NOTE: process-wide. On a GPU, SDPA's cuDNN backend builds a plan for each new shape, and a step's shapes
        # change every step: 7x slower end to end in bf16 on an H200 (docs/compile.md#on-a-gpu). Flash and
        # memory-efficient attention take any shape
        torch.backends.cuda.enable_cudnn_sdp(False)
        self.observers = []
        self.waiting = deque()  # sequences
        self.running = []  # sequences, in the order they started: a fork joins at the tail
        self.finished = []  # requests
        # each running sequence holds a row of these, so a step reads its sampling settings without copying them
        self.free_rows = list(range(max_batch))[::-1]
        self.temperature = torch.zeros(max_batch, device=self.device)
        self.top_k, self.seed = torch.zeros(2, max_batch, dtype=torch.long, device=self.device)

    def notify(self, event, *args):
        for observer in self.observers:
            getattr(observer, event)(*args)

    def add(self, r, arrival=None):
        """Queue a request that arrived at clock time `arrival` (default: now), or refuse it in one line."""
        if r.arrival is not None:
            raise ValueError(f"this request was added before (it is {r.status.value}); a request runs once")
        self.check(r)
        r.arrival = self.clock.now() if arrival is None else arrival
        self.waiting.append(r.sequences[0])

    def check(self, r):
        total = len(r.prompt) + r.max_new_tokens
        if not r.prompt or min(r.prompt) < 0 or max(r.prompt) >= self.num_ids:  # else the step fails for all
            raise ValueError(f"empty prompt, or an id outside the model's 0..{self.num_ids - 1}: {r.prompt[:8]}")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {r.max_new_tokens}; it must be at least 1")
        if total - 1 > self.window:  # the last new token is never fed back, so it needs no position
            why = f"prompt of {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens} = {total}"
            raise ValueError(f"{why} exceeds the model's context of {self.window} (+1: the last is never fed back)")
        if not (math.isfinite(r.temperature) and r.temperature >= 0) or (r.top_k is not None and r.top_k < 1):
            raise ValueError(f"temperature {r.temperature} must be a finite number >= 0 and top_k {r.top_k} >= 1")
        beam_ready = r.n == 1 and r.temperature == 0 and r.top_k is None and r.eos is None
        if min(r.n, r.num_beams) < 1 or (r.num_beams > 1 and not beam_ready):
            why = f"n {r.n} and num_beams {r.num_beams} must be at least 1"
            raise ValueError(f"{why}; beam search is greedy and runs max_new_tokens: no n, temperature, top_k or eos")
        if r.width > self.max_running:
            raise ValueError(f"{r.width} sequences of one request exceed the {self.max_running} that run at once")

    def run(self, requests):
        for r in requests:
            self.add(r)
        while self.waiting or self.running:
            self.step()

    @torch.no_grad()
    def step(self):
        """One forward: plan -> batch -> forward -> sample -> bookkeeping."""
        plan = self.schedule()
        if not plan:  # admission always lets something run; never spin
            raise RuntimeError(f"no progress: {len(self.waiting)} waiting, {len(self.running)} running")
        plan.sort(key=lambda entry: entry.num_tokens > 1)  # one-token entries first: they attend together
        self.notify("planned", plan)
        samplers = self.assign_samplers(plan)
        batch = self.make_batch(plan, samplers)
        logits, _ = self.model(batch.idx, batch=batch)  # (len(samplers), V)
        self.mark_computed(plan)
        self.give_forks_kv(plan, samplers)
        # at least float32, as vLLM's (float64 stays for greedy rows; draws and beam scores are float32);
        # ids past the vocabulary never win
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.vocab_size :] = float("-inf")
        tokens = self.sample(logits, batch, samplers)
        self.notify("sampled", plan)
        self.append(samplers, tokens, logits)
        self.notify("stepped")

    def assign_samplers(self, plan):
        """Fork each prompt of n samples whose last chunk is planned, so that its forks draw in this step too,
        from its logits (they take its K/V once the forward has written them) -> a sampler for each sequence
        whose next token this step draws: each sequence whose last tokens go through the forward, and those
        forks."""
        samplers = []
        for i, (s, num_tokens) in enumerate(plan):
            if num_tokens < s.num_uncomputed():
                continue
            r = s.request
            if r.n > 1 and len(r.sequences) == 1:
                r.sequences += [self.fork(s, r.seed + j) for j in range(1, r.n)]
                samplers += [Sampler(x, i) for x in r.sequences]
            else:
                samplers.append(Sampler(s, i))
        return samplers

    def fork(self, s, seed):  # a sequence that runs on its own from s's tokens and score; fork_kv gives it s's K/V
        child = Sequence(s.request, s.tokens, seed)
        child.score = s.score
        self.start(child, s.status)
        return child

    def start(self, s, status=SequenceStatus.PREFILLING):
        s.row = self.free_rows.pop()
        r = s.request
        r.status = RequestStatus.RUNNING
        self.temperature[s.row] = r.temperature
        # 0: every id is a candidate. NOTE: sample() decides "cut or not" by the same rule, from the request
        self.top_k[s.row] = r.top_k if r.top_k and r.top_k < self.vocab_size else 0
        self.seed[s.row] = s.seed
        s.status = status
        self.running.append(s)

    def mark_computed(self, plan):
        """The plan's new K/V are in the cache."""
        for s, n in plan:
            s.num_computed += n

    def give_forks_kv(self, plan, samplers):
        """The forks made this step take their parent's K/V, now that the forward has written them."""
        for s, i in samplers:
            parent = plan[i].sequence
            if s is not parent:  # a fork draws from its parent's entry
                self.fork_kv(parent, s)

    def sample(self, logits, batch, samplers):
        """A token for every sampler, drawn on the device from its row's settings -> a list: one transfer."""
        # NOTE: a top_k of None or >= vocab_size keeps every id, as start() writes the row's top_k
        sampled_top_ks = [s.request.top_k or self.vocab_size for s, _ in samplers if s.request.temperature > 0]
        cut_top_ks = [k for k in sampled_top_ks if k < self.vocab_size]
        max_top_k = max(cut_top_ks, default=0)
        uncut = len(cut_top_ks) < len(sampled_top_ks)
        rows = batch.sample_rows
        settings = self.temperature[rows], self.top_k[rows], self.seed[rows], batch.sample_pos
        return sample_tokens(logits, *settings, max_top_k, uncut).tolist()

    def append(self, samplers, tokens, logits):
        """Each token joins its sequence, done at max_new_tokens or eos, and its request when all are. A beam
        holds its log-probabilities instead; its group steps when all have theirs."""
        now = self.clock.now()
        beams = [j for j, (s, _) in enumerate(samplers) if s.request.num_beams > 1]
        if beams:  # in float32, as HF's beam search
            logprobs = dict(zip(beams, torch.log_softmax(logits[beams].float(), -1).cpu()))
        for j, ((s, _), token) in enumerate(zip(samplers, tokens)):
            r = s.request
            s.status = SequenceStatus.DECODING
            if r.first_token_at is None:  # a clock may read 0.0
                r.first_token_at = now
            if r.num_beams > 1:
                s.logprobs = logprobs[j]
                if all(b.logprobs is not None for b in r.sequences):
                    self.step_beams(r, now)
                continue
            s.tokens.append(token)
            if len(s.generated) == r.max_new_tokens or token == r.eos:  # its blocks free at once
                self.stop(s, SequenceStatus.DONE)
                if all(x.status is SequenceStatus.DONE for x in r.sequences):
                    self.finish(r, now)

    def step_beams(self, r, now):
        """One step of beam search for r's group, as HF's: the num_beams likeliest continuations of its
        live beams by summed log-probability (float32) survive, best first; a beam continued more than once
        forks, and a beam not continued dies and frees its blocks. Ends when the beams reach max_new_tokens."""
        beams = r.sequences
        scores = torch.stack([b.logprobs for b in beams]) + torch.tensor([b.score for b in beams])[:, None]  # (B, V)
        # fewer than num_beams only when the vocabulary is smaller
        top = scores.flatten().topk(min(r.num_beams, scores.numel()))
        V = scores.shape[1]
        picks = [(beams[i // V], i % V, score) for i, score in zip(top.indices.tolist(), top.values.tolist())]
        parents = [parent for parent, _, _ in picks]
        for b in beams:
            if b not in parents:
                self.stop(b, SequenceStatus.DEAD)
        r.sequences = self.continue_beams(parents)
        for b, (_, token, score) in zip(r.sequences, picks):
            b.tokens.append(token)
            b.score = score
            b.logprobs = None
        if len(r.generated) == r.max_new_tokens:
            for b in r.sequences:
                b.score /= r.max_new_tokens**r.length_penalty  # as HF scores a finished beam
                self.stop(b, SequenceStatus.DONE)
            self.finish(r, now)

    def continue_beams(self, parents):
        """A beam for each pick: its parent the first time, then forks of it that share its K/V. Forks copy
        the parent's tokens before it grows."""
        beams = []
        for parent in parents:
            if parent in beams:  # continued before: fork it
                child = self.fork(parent, parent.seed)
                self.fork_kv(parent, child)
                beams.append(child)
            else:
                beams.append(parent)
        return beams

    def finish(self, r, now):
        r.done_at = now
        r.status = RequestStatus.DONE
        self.finished.append(r)

    def stop(self, s, status):  # done, preempted, or a beam that died
        s.status = status
        s.logprobs = None
        self.running.remove(s)
        self.free_rows.append(s.row)
        self.release(s)
        s.row = None
