"""Requests, the sequences that run for them, and the engine that serves them in steps of one forward:
plan -> batch -> forward -> sample -> bookkeeping. PagedEngine keeps K/V in the block pool (paged.py), with
chunked prefill, backpressure, prefix caching, preemption, and forks that share blocks (samples, beams)."""

import hashlib
import itertools
import math
import time
from array import array
from collections import deque
from types import SimpleNamespace

import torch

from model import prepack
from model import sample as sample_logits
from paged import BlockAllocator, PagedBatch


class Request:
    """What a user asks for, its times, and its sequences: one until its prompt is computed, then n samples
    in order, or num_beams live beams best first."""

    def __init__(
        self, prompt, max_new_tokens, temperature=0, top_k=None, seed=0, n=1, num_beams=1, length_penalty=1.0, eos=None
    ):
        self.prompt, self.max_new_tokens = list(prompt), max_new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed  # sample i of n draws with seed + i
        self.n, self.num_beams, self.length_penalty = n, num_beams, length_penalty
        self.eos = eos  # a token that ends each sequence sampling it (as HF's eos_token_id); None: only max_new_tokens
        self.status = "waiting"  # -> running -> done
        self.arrival = self.first_token_at = self.done_at = None
        self.width = max(n, num_beams)  # the sequences it runs at once
        self.sequences = [Sequence(self, prompt, seed)]

    @property
    def generated(self):  # the first sample, or the best beam
        return self.sequences[0].generated


class Sequence:
    """What runs: tokens whose K/V the engine computes, through a block table, in a row of the engine's
    per-sequence tensors. A fork starts from its parent's tokens, score and K/V, with its own seed."""

    def __init__(self, request, tokens, seed):
        self.request, self.tokens, self.seed = request, list(tokens), seed
        self.status = "waiting"  # -> prefilling -> decoding -> done; a preempted one waits again; a beam dies
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


WALL_CLOCK = SimpleNamespace(now=time.perf_counter, sleep=time.sleep)  # the harness sleeps; tests swap in fakes


class Engine:
    """Runs requests to completion. Subclasses choose each step's tokens (schedule) and keep K/V (make_batch,
    fork_kv, release)."""

    def __init__(self, model, max_batch=64, vocab_size=None, clock=None):
        if max_batch < 1:
            raise ValueError(f"max_batch is {max_batch}; it must be at least 1")
        self.model, self.max_batch, self.window = model, max_batch, model.config.block_size
        prepack(model)  # on a CPU, linear weights in oneDNN's layout, once
        self.max_running = max_batch  # sequences at once
        # ids from vocab_size on are never sampled: nanoGPT pads GPT-2's 50,257 tokens to 50,304 ids
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = model.lm_head.weight.device
        self.clock = clock or WALL_CLOCK
        self.waiting, self.running, self.finished = deque(), [], []  # sequences, sequences, requests
        # each running sequence holds a row of these, so a step reads its sampling settings without copying them
        self.free_rows = list(range(max_batch - 1, -1, -1))
        self.temperature = torch.zeros(max_batch, device=self.device)
        self.top_k, self.seed = (torch.zeros(max_batch, dtype=torch.long, device=self.device) for _ in range(2))

    def add(self, r, arrival=None):
        """Queue a request that arrived at clock time `arrival` (default: now), or refuse it in one line."""
        if r.arrival is not None:
            raise ValueError(f"this request was added before (it is {r.status}); a request runs once")
        self.check(r)
        r.arrival = self.clock.now() if arrival is None else arrival
        self.waiting.append(r.sequences[0])

    def check(self, r):
        num_prompt, total = len(r.prompt), len(r.prompt) + r.max_new_tokens
        if num_prompt == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {r.max_new_tokens}; it must be at least 1")
        if total - 1 > self.window:  # the last new token is never fed back, so it needs no position
            why = f"prompt of {num_prompt} tokens + max_new_tokens {r.max_new_tokens} = {total}"
            raise ValueError(f"{why} exceeds the model's context of {self.window} (+1: the last is never fed back)")
        if not (math.isfinite(r.temperature) and r.temperature >= 0) or (r.top_k is not None and r.top_k < 1):
            raise ValueError(f"temperature {r.temperature} must be a finite number >= 0 and top_k {r.top_k} >= 1")
        greedy = r.n == 1 and r.temperature == 0 and r.top_k is None and r.eos is None
        if min(r.n, r.num_beams) < 1 or (r.num_beams > 1 and not greedy):
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
        plan = sorted(self.schedule(), key=lambda entry: entry[1] > 1)  # [(sequence, new tokens)], one-token first
        if not plan:  # admission always lets something run; never spin
            raise RuntimeError(f"no progress: {len(self.waiting)} waiting, {len(self.running)} running")
        samplers = self.due(plan)
        batch = self.make_batch(plan, samplers)
        logits, _ = self.model(batch.idx, batch=batch)  # (len(samplers), V)
        self.computed(plan, samplers)
        # sampling and beam scores read float32 (float64 stays), as vLLM's; ids past the vocabulary never win
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.vocab_size :] = float("-inf")
        tokens = self.sample(logits, batch, samplers)
        self.append(samplers, tokens, logits)

    def due(self, plan):
        """The step's samplers: (plan entry, sequence) for each sequence whose next token is due. A prompt of n
        samples forks here, before the forward, so its forks' rows join the step's batch."""
        samplers = []
        for i, s in [(i, s) for i, (s, n) in enumerate(plan) if s.num_computed + n == len(s.tokens)]:
            r = s.request
            if r.n > 1 and len(r.sequences) == 1:  # its prompt completes now: fork
                r.sequences += [self.fork(s, r.seed + j) for j in range(1, r.n)]
                samplers += [(i, x) for x in r.sequences]
            else:
                samplers.append((i, s))
        return samplers

    def fork(self, s, seed):  # a sequence that runs on its own from s's tokens and score; fork_kv gives it s's K/V
        child = Sequence(s.request, s.tokens, seed)
        child.block_hashes, child.score = s.block_hashes[:], s.score
        self.start(child, s.status)
        return child

    def start(self, s, status="prefilling"):
        s.row = self.free_rows.pop()
        r = s.request
        r.status = "running"
        top_k = r.top_k if r.top_k and r.top_k < self.vocab_size else 0  # 0: every id is a candidate
        self.temperature[s.row], self.top_k[s.row], self.seed[s.row] = r.temperature, top_k, s.seed
        s.status = status
        self.running.append(s)

    def computed(self, plan, samplers):
        """The plan's new K/V are in the cache; a fork made this step takes its parent's now: they were just written."""
        for s, n in plan:
            s.num_computed += n
        for i, s in samplers:
            if s is not plan[i][0]:
                self.fork_kv(plan[i][0], s)

    def sample(self, logits, batch, samplers):
        """A token for every sampler, drawn on the device from its row's settings -> a list: one transfer."""
        hot = [s.request.top_k or self.vocab_size for _, s in samplers if s.request.temperature > 0]
        cuts = [k for k in hot if k < self.vocab_size]
        rows = batch.sample_rows
        settings = self.temperature[rows], self.top_k[rows], self.seed[rows], batch.sample_pos
        return sample_logits(logits, *settings, max(cuts, default=0), len(cuts) < len(hot)).tolist()

    def append(self, samplers, tokens, logits):
        """Each token joins its sequence, done at max_new_tokens, and its request when all are. A beam holds its
        log-probabilities instead; its group steps when all have theirs."""
        now = self.clock.now()
        beams = [j for j, (_, s) in enumerate(samplers) if s.request.num_beams > 1]
        if beams:  # in float32, as HF's beam search
            logprobs = dict(zip(beams, torch.log_softmax(logits[beams].float(), -1).cpu()))
        for j, ((_, s), token) in enumerate(zip(samplers, tokens)):
            r = s.request
            s.status, r.first_token_at = "decoding", r.first_token_at or now
            if r.num_beams > 1:
                s.logprobs = logprobs[j]
                if all(b.logprobs is not None for b in r.sequences):
                    self.step_beams(r, now)
                continue
            s.tokens.append(token)
            if len(s.generated) == r.max_new_tokens or token == r.eos:  # its blocks free at once
                self.stop(s, "done")
                if all(x.status == "done" for x in r.sequences):
                    r.done_at, r.status = now, "done"
                    self.finished.append(r)

    def step_beams(self, r, now):
        """One step of beam search for r's group, as HF's: the num_beams likeliest continuations of its
        live beams by summed log-probability (float32) survive, best first; a beam continued more than once
        forks, and a beam not continued dies and frees its blocks. Ends when the beams reach max_new_tokens."""
        beams = r.sequences
        scores = torch.stack([b.logprobs for b in beams]) + torch.tensor([b.score for b in beams])[:, None]  # (B, V)
        top = scores.flatten().topk(min(r.num_beams, scores.numel()))  # the first step may have fewer
        V = scores.shape[1]
        picks = [(beams[i // V], i % V, score) for i, score in zip(top.indices.tolist(), top.values.tolist())]
        parents = {id(parent) for parent, _, _ in picks}
        for b in beams:
            if id(b) not in parents:
                self.stop(b, "dead")
        taken, r.sequences = set(), []
        for parent, _, _ in picks:  # forks first take a copy of the parent's tokens, before it grows
            if id(parent) in taken:
                r.sequences.append(self.fork(parent, parent.seed))
                self.fork_kv(parent, r.sequences[-1])
            else:
                r.sequences.append(parent)
            taken.add(id(parent))
        for b, (_, token, score) in zip(r.sequences, picks):
            b.tokens.append(token)
            b.score, b.logprobs = score, None
        if len(r.generated) == r.max_new_tokens:
            for b in r.sequences:
                b.score /= r.max_new_tokens**r.length_penalty  # as HF scores a finished beam
                self.stop(b, "done")
            r.done_at, r.status = now, "done"
            self.finished.append(r)

    def stop(self, s, status):  # done, preempted, or a beam that died
        s.status, s.logprobs = status, None
        self.running.remove(s)
        self.free_rows.append(s.row)
        self.release(s)
        s.row = None


class PagedEngine(Engine):
    """K/V in a pool of blocks. A step takes every decoding sequence's next token, then prefill chunks of
    admitted sequences, then newly admitted ones, up to token_budget tokens in all."""

    def __init__(
        self, model, num_blocks, block_size=16, token_budget=512, max_batch=64, prefix_cache=True, compile="auto", **kw
    ):
        super().__init__(model, max_batch, **kw)  # and vocab_size, clock
        if min(block_size, token_budget, num_blocks) < 1 or compile not in ("auto", "on", "off"):
            why = f"block_size {block_size}, token_budget {token_budget}, num_blocks {num_blocks} must be >= 1"
            raise ValueError(f"{why}, compile {compile!r} auto, on or off")
        self.allocator = BlockAllocator(num_blocks)
        c = model.config  # the pool, allocated once; (layer, head)'s own is k_pool[layer, :, :, head]
        shape = (c.n_layer, num_blocks + 1, block_size, c.n_head, c.n_embd // c.n_head)  # + the padding block
        self.k_pool = torch.zeros(shape, device=self.device, dtype=model.lm_head.weight.dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.block_size, self.token_budget, self.prefix_cache = block_size, token_budget, prefix_cache
        # auto: compiled decode attention on a GPU, and on a CPU from 16 decode rows: as fast there or faster
        self.compile, self.compile_from = compile, 1 if compile == "on" or self.k_pool.is_cuda else 16
        self.max_running = min(max_batch, token_budget)  # so every decoding sequence fits in a step
        self.watermark = max(1, num_blocks // 100)  # kept free at admission, for running sequences to grow
        # each running sequence's block table in its row, updated as it grows: no step rebuilds one from a list
        shape, pinned = (max_batch, blocks_for(self.window, block_size)), self.k_pool.is_cuda
        self.block_tables = torch.full(shape, self.allocator.padding_block, dtype=torch.int32, pin_memory=pinned)

    def check(self, r):
        super().check(r)
        need = blocks_for(len(r.prompt) + r.max_new_tokens - 1, self.block_size)  # the last token is never fed back
        if need * r.num_beams > self.allocator.num_blocks:  # a preempted beam group comes back whole
            why = f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens needs {need} blocks of {self.block_size}"
            each = f" for each of {r.num_beams} beams" if r.num_beams > 1 else ""
            raise ValueError(f"{why}{each}, but the pool has only {self.allocator.num_blocks}")

    def schedule(self):
        decoding = [s for s in self.running if s.status == "decoding" and s.logprobs is None]
        for s in decoding:  # oldest first, so preemption takes the newest
            if s.row is not None:
                self.reserve_slot(s)
        # a reservation may preempt sequences that reserved before it: a beam group is preempted whole
        plan = [(s, 1) for s in decoding if s.row is not None]
        budget = self.token_budget - len(plan)
        prefilling = [s for s in self.running if s.status == "prefilling"]
        while self.waiting and budget > sum(len(s.tokens) - s.num_computed for s in prefilling):
            admitted = self.admit(self.waiting[0])
            if not admitted:
                break
            prefilling += admitted
        for s in prefilling:  # chunks in admission order until the budget runs out
            if budget > 0:
                plan.append((s, min(len(s.tokens) - s.num_computed, budget)))
                budget -= plan[-1][1]
        return plan

    def reserve_slot(self, s):
        """Give s's next token a slot of its own: a new block when its last is full, a copy of its last when a
        fork shares it (copy-on-write: full blocks are never written). With no block free even after evicting
        cached ones, preempt the newest running sequence, s itself included."""
        k = s.num_computed // self.block_size  # the block its next token goes in
        if k < len(s.block_table) and not self.allocator.is_shared(s.block_table[k]):
            return
        while not self.allocator.can_allocate(1):  # a beam group goes whole: a beam needs all its group to step
            newest, r = self.running[-1], self.running[-1].request
            group = [x for x in self.running if x.request is r] if r.num_beams > 1 else [newest]
            for victim in reversed(group):
                self.preempt(victim)
            if s in group:
                return
        [block] = self.allocator.allocate(1)
        if k < len(s.block_table):  # copy the shared block's K/V in every layer, then let go of it
            shared = s.block_table[k]
            self.k_pool[:, block], self.v_pool[:, block] = self.k_pool[:, shared], self.v_pool[:, shared]
            self.allocator.free([shared])
            s.block_table[k] = block
        else:
            s.block_table.append(block)
        self.block_tables[s.row, k] = block

    def preempt(self, s):
        """Free s's blocks (hashed ones stay cached) and requeue it first, to recompute its K/V when readmitted."""
        self.stop(s, "waiting")
        s.num_computed = 0
        self.waiting.appendleft(s)

    def admit(self, s):
        """Admit s, with its beam group if preempted as one, if free blocks cover its tokens less the cached
        ones, and its forks' copies of a shared last block, and leave the watermark. -> the admitted, or none:
        s waits, and so does everyone behind it."""
        same = lambda x: x.request is s.request
        group = list(itertools.takewhile(same, self.waiting)) if s.request.num_beams > 1 else [s]
        if sum(x.num_rows() for x in self.running + group) > self.max_running:
            return []
        hits = [self.cached_prefix(x) if self.prefix_cache else [] for x in group]
        if len(group) == 1 and self.prefix_cache and self.prefix_in_flight(s, len(hits[0])):
            return []  # a running sequence is computing this prefix's next block: wait and share it
        new_blocks = [blocks_for(len(x.tokens), self.block_size) - len(h) for x, h in zip(group, hits)]
        revived = {b for h in hits for b in h if self.allocator.ref_count[b] == 0}  # free cached hits count
        copies = (s.num_rows() - 1) * (len(s.tokens) % self.block_size > 0)  # alone, its forks may preempt each other
        need = sum(new_blocks) + len(revived) + (copies + self.watermark) * bool(self.running)
        if not self.allocator.can_allocate(need):
            return []
        for x, h, n in zip(group, hits, new_blocks):
            for block in h:
                self.allocator.share(block)
            x.block_table = h + self.allocator.allocate(n)
            x.num_computed = len(h) * self.block_size
            self.waiting.popleft()
            self.start(x)
            self.block_tables[x.row, : len(x.block_table)] = torch.tensor(x.block_table, dtype=torch.int32)
        return group

    def block_tokens(self, s, k):
        return tuple(s.tokens[k * self.block_size : (k + 1) * self.block_size])

    def block_hash(self, s, k):
        """Chained: block k's hash covers block k-1's, so a hit on block k means blocks 0..k all match."""
        while len(s.block_hashes) <= k:
            parent = s.block_hashes[-1] if s.block_hashes else b""
            tokens = array("q", self.block_tokens(s, len(s.block_hashes))).tobytes()
            s.block_hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
        return s.block_hashes[k]

    def cached_prefix(self, s):
        """The cached full blocks heading s's tokens; the last token is always computed: its logits start generation."""
        hits = []
        for k in range((len(s.tokens) - 1) // self.block_size):
            block = self.allocator.lookup(self.block_hash(s, k), self.block_tokens(s, k))
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_in_flight(self, s, k):
        """Is a prefilling sequence computing block k of the same prefix right now?"""
        if k >= (len(s.tokens) - 1) // self.block_size:
            return False
        h, full = self.block_hash(s, k), (k + 1) * self.block_size
        computing = [x for x in self.running if x.status == "prefilling" and x.num_computed < full <= len(x.tokens)]
        return any(self.block_hash(x, k) == h for x in computing)

    def make_batch(self, plan, samplers):
        compiled = self.compile != "off" and sum(n == 1 for _, n in plan) >= self.compile_from
        padding = self.allocator.padding_block
        return PagedBatch(plan, samplers, self.k_pool, self.v_pool, self.block_tables, padding, compiled)

    def computed(self, plan, samplers):
        super().computed(plan, samplers)
        if self.prefix_cache:  # register the blocks that just filled
            for s, n in plan:
                for k in range((s.num_computed - n) // self.block_size, s.num_computed // self.block_size):
                    self.allocator.register(s.block_table[k], self.block_hash(s, k), self.block_tokens(s, k))

    def fork_kv(self, parent, child):
        for block in parent.block_table:
            self.allocator.share(block)
        child.block_table, child.num_computed = parent.block_table[:], parent.num_computed
        self.block_tables[child.row] = self.block_tables[parent.row]

    def release(self, s):
        self.allocator.free(s.block_table)
        s.block_table = []


def blocks_for(num_tokens, block_size):
    return -(-num_tokens // block_size)
