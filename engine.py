"""The engine that serves requests (sequence.py) in steps of one forward: plan -> batch -> forward -> sample
-> bookkeeping. A subclass decides what runs (schedule) and where K/V
live (make_batch, fork_kv, release): PagedEngine (scheduler.py) and ContiguousEngine (contiguous.py)."""

import ctypes
import math
import sys
import time
from collections import deque
from types import SimpleNamespace
from typing import NamedTuple

import torch

from batch import Staging
from prepack import prepack
from sampling import sample
from sequence import RequestStatus, Sequence, SequenceStatus


class PlanEntry(NamedTuple):
    """A sequence's part of a step: its next num_tokens tokens go through the forward."""

    sequence: Sequence
    num_tokens: int


class Sampler(NamedTuple):
    """A sequence whose next token this step draws, from the logits of plan entry `entry`'s last token."""

    sequence: Sequence
    entry: int


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

    def __init__(self, model, *, max_batch=64, vocab_size=None, clock=None):
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
        # the largest step: max_batch sequences of a whole context, with block tables of one-token blocks
        self.staging = Staging(self.device, max_batch * (5 * self.window + 8))
        self.clock = clock or WALL_CLOCK
        prepack(model)  # on a CPU, the linears multiply oneDNN's packed copies of their weights (prepack.py)
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

    def notify(self, event, *args):  # each observer is an observer.Observer: it has a method for every event
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
        p = r.params
        if not (math.isfinite(p.temperature) and p.temperature >= 0) or (p.top_k is not None and p.top_k < 1):
            raise ValueError(f"temperature {p.temperature} must be a finite number >= 0 and top_k {p.top_k} >= 1")
        beam_ready = p.n == 1 and p.temperature == 0 and p.top_k is None and p.eos is None
        if min(p.n, p.num_beams) < 1 or (p.num_beams > 1 and not beam_ready):
            why = f"n {p.n} and num_beams {p.num_beams} must be at least 1"
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
        plan.sort(key=lambda e: e.num_tokens > 1)  # one-token entries first: they attend together
        self.notify("planned", plan)
        samplers = self.assign_samplers(plan)
        batch = self.make_batch(plan, samplers)
        logits = self.forward(batch)[: len(samplers)]  # (S, V)
        self.mark_computed(plan)
        self.give_forks_kv(plan, samplers)
        # at least float32, as vLLM's (float64 stays for greedy rows; draws and beam scores are float32);
        # ids past the vocabulary never win
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.vocab_size :] = float("-inf")
        tokens = self.sample(logits, batch, samplers).tolist()  # the step's one transfer to the host
        self.notify("sampled", plan)
        now = self.clock.now()
        self.start_decoding(samplers, now)
        beams = [(j, s) for j, (s, _) in enumerate(samplers) if s.request.params.num_beams > 1]
        self.append_tokens([(s, t) for (s, _), t in zip(samplers, tokens) if s.request.params.num_beams == 1], now)
        if beams:
            self.hold_logprobs(beams, logits, now)
        self.notify("stepped")

    def forward(self, batch):
        return self.model(batch.idx, batch=batch)[0]

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
            if r.params.n > 1 and len(r.sequences) == 1:
                r.sequences += [self.fork(s, r.params.seed + j) for j in range(1, r.params.n)]
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
        s.request.status = RequestStatus.RUNNING
        # the one place a sequence's settings take their device form; on the device a top_k of 0 keeps every id
        self.temperature[s.row] = s.request.params.temperature
        self.top_k[s.row] = s.request.params.cut(self.vocab_size) or 0
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
            if s is not plan[i].sequence:  # a fork draws from its parent's entry
                self.fork_kv(plan[i].sequence, s)

    def sample(self, logits, batch, samplers):
        """A token for every sampler, drawn on the device from its row's settings: (S,), left on the device."""
        cuts = [s.request.params.cut(self.vocab_size) for s, _ in samplers if s.request.params.temperature > 0]
        rows = batch.sample_rows
        return sample(
            logits,
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            seed=self.seed[rows],
            position=batch.sample_pos,
            max_top_k=max(filter(None, cuts), default=0),
            uncut=None in cuts,
        )

    def start_decoding(self, samplers, now):
        """The sampled sequences decode from now on; a request's first token is stamped."""
        for s, _ in samplers:
            s.status = SequenceStatus.DECODING
            if s.request.first_token_at is None:  # a clock may read 0.0
                s.request.first_token_at = now

    def append_tokens(self, sequence_tokens, now):
        """Each token joins its sequence, done at max_new_tokens or eos; its request is done when all are."""
        for s, token in sequence_tokens:
            r = s.request
            s.tokens.append(token)
            if len(s.tokens) - len(r.prompt) == r.max_new_tokens or token == r.params.eos:  # its blocks free at once
                self.stop(s, SequenceStatus.DONE)
                if all(x.status is SequenceStatus.DONE for x in r.sequences):
                    self.finish(r, now)

    def hold_logprobs(self, beams, logits, now):
        """Each beam (sampler j, sequence) holds its next-token log-probabilities, in float32 as HF's beam
        search; a group steps once all its beams hold theirs."""
        logprobs = torch.log_softmax(logits[[j for j, _ in beams]].float(), -1).cpu()
        for (_, s), row in zip(beams, logprobs):
            s.logprobs = row
            if all(b.logprobs is not None for b in s.request.sequences):
                self.step_beams(s.request, now)

    def step_beams(self, r, now):
        """One step of beam search for r's group, as HF's: the num_beams likeliest continuations of its
        live beams by summed log-probability (float32) survive, best first; a beam continued more than once
        forks, and a beam not continued dies and frees its blocks. Ends when the beams reach max_new_tokens."""
        beams = r.sequences
        scores = torch.stack([b.logprobs for b in beams]) + torch.tensor([b.score for b in beams])[:, None]  # (B, V)
        # fewer than num_beams only when the vocabulary is smaller
        top = scores.flatten().topk(min(r.params.num_beams, scores.numel()))
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
                b.score /= r.max_new_tokens**r.params.length_penalty  # as HF scores a finished beam
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
