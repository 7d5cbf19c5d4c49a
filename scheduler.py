"""Requests and the engine that serves them. Engine.step is one model forward: plan (which requests
bring how many tokens) -> batch (where their K/V go, what they read) -> forward -> sample -> bookkeeping.
Scheduler, the paged engine, plans decode plus chunked prefill under a token budget, with
backpressure, prefix caching, preemption, and forks that share blocks (n samples, beam search).
The baseline it is measured against, ContiguousEngine, is in generate.py with the experiments."""
import copy
import hashlib
import heapq
import itertools
import math
import time
from array import array
from collections import deque
from types import SimpleNamespace

import torch

from paged import BlockAllocator, PagedBatch

class Request:
    """What a user asks for, and the one sequence the engine runs for it. For n samples or num_beams beams
    it forks once its prompt is computed: each fork is a Request that shares its blocks. The one the user
    added (the root) keeps the group: its sequences, and at the end the best one's tokens as its own."""

    def __init__(self, prompt, max_new_tokens, temperature=0.0, top_k=None, seed=0, n=1, num_beams=1,
                 length_penalty=1.0):
        self.tokens = list(prompt)  # the prompt, then each generated token
        self.num_prompt, self.max_new_tokens = len(prompt), max_new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed  # sample i of n draws with seed + i
        self.n, self.num_beams, self.length_penalty = n, num_beams, length_penalty
        self.status = "waiting"  # -> prefilling -> decoding -> done; a preempted request waits again; a beam dies
        self.row = None  # while running: its row in the engine's per-request tensors
        self.block_table = []  # physical block of each logical block
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_hashes = []  # chained hash of each full block of tokens, computed once each
        self.arrival = self.first_token_at = self.done_at = None
        self.root, self.sequences = self, [self]  # the group: samples in order, or live beams best first
        self.score, self.logprobs = 0.0, None  # a beam's log-probability, and its next token's, held for the group

    @property
    def generated(self):
        return self.tokens[self.num_prompt:]

    def width(self):  # rows this sequence will take: one, or its group's all before it forks
        return max(self.n, self.num_beams) if self.sequences == [self] else 1

    def fork(self, seed):
        child = copy.copy(self)
        child.tokens, child.block_table, child.block_hashes = self.tokens[:], self.block_table[:], self.block_hashes[:]
        child.seed, child.row, child.sequences = seed, None, None
        return child

def mix32(x):
    """A 32-bit integer hash (hash-prospector's lowbias32, second constants) in int64 tensor ops: both
    multipliers are below 2**31, so no product of a 32-bit x overflows, on any device."""
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)

def uniform(seed, position):
    """seed, position: (R,) int64 -> (R,) floats in [0, 1), a hash of (seed, position). There is no
    generator state to carry, capture or copy: a request's draw at position p is the same whatever else
    runs in its batch and whatever ran before."""
    x = mix32((mix32(seed & 0xFFFFFFFF) + position) & 0xFFFFFFFF)
    return (x >> 8).float() / (1 << 24)  # 24 bits, each value exact in float32

def argmax(logits):  # (R, V) -> (R,)
    # NOTE: on a CPU, torch's argmax over (64, 50304) logits took 4 ms and numpy's 0.9 ms (torch 2.13)
    if logits.device.type == "cpu" and logits.dtype != torch.bfloat16:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)

def invert_cdf(candidates, temperature, u):
    """candidates (R, C), temperature, u: (R,) -> (R, 1): the column whose softmax CDF first passes u."""
    # the max is subtracted before dividing, so a tiny temperature tends to greedy instead of overflowing
    cdf = ((candidates - candidates.max(-1, keepdim=True).values) / temperature[:, None]).softmax(-1).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.size(1) - 1)

def sample(logits, temperature, top_k, seed, position, max_top_k=0, uncut=True):
    """logits (R, V); temperature, top_k (0: keep every id), seed, position: (R,) -> (R,) token ids, on the
    logits' device, with no host sync. Greedy rows (temperature 0) take the argmax; the others sample with
    nanoGPT's temperature and top-k at uniform(seed, position). A row's candidates are its own top_k best,
    sorted, or every id in vocabulary order, whatever its batch holds. max_top_k: the largest top_k of a
    sampled row, 0 if none cuts; uncut: whether some sampled row keeps every id."""
    tokens = argmax(logits)
    if not (uncut or max_top_k):  # every row greedy
        return tokens
    hot = temperature > 0
    temperature, u = torch.where(hot, temperature, 1.0), uniform(seed, position)
    if uncut:
        tokens = torch.where(hot & (top_k == 0), invert_cdf(logits.float(), temperature, u)[:, 0], tokens)
    if max_top_k:  # (R, K): the K best, sorted, so a row's own top_k is a prefix
        values, ids = logits.float().topk(max_top_k)
        values = values.masked_fill(torch.arange(max_top_k, device=logits.device) >= top_k[:, None], float("-inf"))
        tokens = torch.where(hot & (top_k > 0), ids.gather(1, invert_cdf(values, temperature, u))[:, 0], tokens)
    return tokens

# wall time: the engine only asks now() and sleep(), so a test can swap in a fake clock
WALL_CLOCK = SimpleNamespace(now=time.perf_counter, sleep=time.sleep)

class Engine:
    """Runs requests to completion. Subclasses choose each step's tokens (schedule) and where their
    K/V live (make_batch, release, kv_slots)."""

    def __init__(self, model, max_batch=64, num_tokens=None, clock=None):
        if max_batch < 1:
            raise ValueError(f"max_batch is {max_batch}; it must be at least 1")
        self.model, self.max_batch, self.context = model, max_batch, model.config.block_size
        self.max_running = max_batch  # sequences at once
        # ids from num_tokens on are never sampled: nanoGPT pads GPT-2's 50,257 tokens to 50,304 ids
        self.num_tokens = num_tokens or model.config.vocab_size
        self.device = model.lm_head.weight.device
        self.clock = clock or WALL_CLOCK
        self.arriving = []  # a heap of (arrival, order, request) not yet arrived
        self.order = itertools.count()
        self.waiting, self.running, self.finished = deque(), [], []
        # each running request holds a row of these, so a step reads its sampling settings without copying them
        self.free_rows = list(range(max_batch - 1, -1, -1))
        self.temperature = torch.zeros(max_batch, device=self.device)
        self.top_k, self.seed = (torch.zeros(max_batch, dtype=torch.long, device=self.device) for _ in range(2))
        self.stats = []  # one record per step, for metrics and plots
        self.prefill_tokens = self.num_preemptions = 0

    def add(self, r, arrival=None):
        """Queue a request that arrives at clock time `arrival` (default: now), or refuse it with a
        one-line ValueError if it can never run or was added before."""
        if r.arrival is not None:
            raise ValueError(f"this request was added before (it is {r.status}); a request runs once")
        self.check(r)
        r.arrival = self.clock.now() if arrival is None else arrival
        heapq.heappush(self.arriving, (r.arrival, next(self.order), r))

    def check(self, r):
        total = r.num_prompt + r.max_new_tokens
        if r.num_prompt == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {r.max_new_tokens}; it must be at least 1")
        if total - 1 > self.context:  # the last new token is never fed back, so it needs no position
            raise ValueError(f"prompt of {r.num_prompt} tokens + max_new_tokens {r.max_new_tokens} = {total} "
                             f"exceeds the model's context of {self.context} (+1: the last token is never fed back)")
        if not (math.isfinite(r.temperature) and r.temperature >= 0) or (r.top_k is not None and r.top_k < 1):
            raise ValueError(f"temperature {r.temperature} must be a finite number >= 0 and top_k {r.top_k} >= 1")
        if min(r.n, r.num_beams) < 1 or (r.num_beams > 1 and (r.n > 1 or r.temperature > 0 or r.top_k)):
            raise ValueError(f"n {r.n} and num_beams {r.num_beams} must be at least 1; beam search is greedy: "
                             "it takes no n, temperature or top_k")
        if r.width() > self.max_running:
            raise ValueError(f"{r.width()} sequences of one request exceed the {self.max_running} that run at once")

    def run(self, requests, arrivals=None):
        for r, arrival in zip(requests, arrivals or [None] * len(requests)):
            self.add(r, arrival)
        while self.arriving or self.waiting or self.running:
            self.step()
        return requests

    def start(self, r, status="prefilling"):
        r.row = self.free_rows.pop()
        top_k = r.top_k if r.top_k and r.top_k < self.num_tokens else 0  # 0: every id is a candidate
        self.temperature[r.row], self.top_k[r.row], self.seed[r.row] = r.temperature, top_k, r.seed
        r.status = status
        self.running.append(r)

    def stop(self, r, status):  # done, preempted, or a beam that died
        r.status, r.logprobs = status, None
        self.running.remove(r)
        self.free_rows.append(r.row)
        self.release(r)
        r.row = None

    def fork(self, r, seed):  # a new sequence sharing r's tokens and K/V, that runs on its own from here
        child = r.fork(seed)
        self.start(child, r.status)
        self.forked(r, child)
        return child

    def finish(self, root, now):  # every sequence of root is done
        root.done_at, root.status = now, "done"
        root.sequences = [copy.copy(s) if s is root else s for s in root.sequences]  # root's own, kept apart
        root.tokens = list(root.sequences[0].tokens)  # beams: the best one's; samples: root's own
        self.finished.append(root)

    def take_arrivals(self):
        while self.arriving and self.arriving[0][0] <= self.clock.now():
            self.waiting.append(heapq.heappop(self.arriving)[2])

    @torch.no_grad()
    def step(self):
        self.take_arrivals()
        while self.arriving and not self.waiting and not self.running:  # idle: sleep until the next arrival
            self.clock.sleep(max(0.0, self.arriving[0][0] - self.clock.now()))
            self.take_arrivals()
        plan = self.schedule()  # [(request, number of new tokens)]
        if not plan:  # admission always lets something run; never spin
            raise RuntimeError(f"no progress: {len(self.waiting)} waiting, {len(self.running)} running")
        plan.sort(key=lambda item: item[1] > 1)  # one-token requests first, as StepBatch wants
        start = self.clock.now()
        new = itertools.chain.from_iterable(r.tokens[r.num_computed:r.num_computed + n] for r, n in plan)
        ready = [i for i, (r, n) in enumerate(plan) if r.num_computed + n == len(r.tokens)]  # next token due
        batch = self.make_batch(plan, ready, torch.tensor(list(new)))
        logits, _ = self.model(batch.idx, cache=batch)  # (len(ready), V)
        logits[:, self.num_tokens:] = float("-inf")  # in place: argmax over a slice ran 4x slower (numpy)
        for r, n in plan:
            self.prefill_tokens += n if r.status == "prefilling" else 0
            r.num_computed += n
            self.computed(r, n)
        samplers, source = [plan[i][0] for i in ready], list(range(len(ready)))  # the sequence each row starts
        rows, positions = batch.sample_rows, batch.sample_pos
        for i, r in enumerate(samplers[: len(ready)]):  # n samples: forks of a computed prompt share its logits
            if r.n > 1 and r.sequences == [r]:
                r.sequences += [self.fork(r, r.seed + j) for j in range(1, r.n)]
                samplers, source = samplers + r.sequences[1:], source + [i] * (r.n - 1)
        if len(samplers) > len(ready):  # the forks' rows are not in the staged batch: copy them now
            logits, rows = logits[source], torch.tensor([r.row for r in samplers], device=self.device)
            positions = torch.tensor([len(r.tokens) for r in samplers], device=self.device)
        hot = [r.top_k or self.num_tokens for r in samplers if r.temperature > 0]
        cuts = [k for k in hot if k < self.num_tokens]
        settings = self.temperature[rows], self.top_k[rows], self.seed[rows], positions
        new_tokens = sample(logits, *settings, max(cuts, default=0), len(cuts) < len(hot)).tolist()  # one transfer
        beams = [j for j, r in enumerate(samplers) if r.num_beams > 1]
        if beams:  # in float32, as HF's beam search
            logprobs = dict(zip(beams, torch.log_softmax(logits[beams].float(), -1).cpu()))
        now = self.clock.now()
        context = sum(r.num_computed for r, _ in plan)
        self.stats.append(dict(seconds=now - start, running=len(self.running), context=context, **self.kv_slots()))
        for j, (r, token) in enumerate(zip(samplers, new_tokens)):
            r.status, r.root.first_token_at = "decoding", r.root.first_token_at or now
            if r.num_beams > 1:  # held until every beam of its group has its own
                r.logprobs = logprobs[j]
                if all(b.logprobs is not None for b in r.root.sequences):
                    self.step_beams(r.root, now)
                continue
            r.tokens.append(token)
            if len(r.tokens) - r.num_prompt == r.max_new_tokens:
                self.stop(r, "done")
                if all(s.status == "done" for s in r.root.sequences):
                    self.finish(r.root, now)

    def step_beams(self, root, now):
        """One step of beam search for root's group, as HF's: the num_beams likeliest continuations of its
        live beams by summed log-probability (float32) survive, best first; a beam continued more than once
        forks, and a beam not continued dies and frees its blocks. Ends when the beams reach max_new_tokens."""
        beams = root.sequences
        scores = torch.stack([b.logprobs for b in beams]) + torch.tensor([b.score for b in beams])[:, None]  # (live, V)
        top = scores.flatten().topk(min(root.num_beams, scores.numel()))  # the first step may have fewer
        V = scores.shape[1]
        picks = [(beams[i // V], i % V, score) for i, score in zip(top.indices.tolist(), top.values.tolist())]
        parents = {id(parent) for parent, _, _ in picks}
        for b in beams:
            if id(b) not in parents:
                self.stop(b, "dead")
        taken, root.sequences = set(), []
        for parent, token, score in picks:  # forks first take a copy of the parent's tokens, before it grows
            root.sequences.append(parent if id(parent) not in taken else self.fork(parent, parent.seed))
            taken.add(id(parent))
        for b, (_, token, score) in zip(root.sequences, picks):
            b.tokens.append(token)
            b.score, b.logprobs = score, None
        if len(root.sequences[0].tokens) - root.num_prompt == root.max_new_tokens:
            for b in root.sequences:
                b.score /= root.max_new_tokens**root.length_penalty  # as HF scores a finished beam
                self.stop(b, "done")
            self.finish(root, now)

    def computed(self, r, n):  # hook: r's K/V just grew by n tokens
        pass

class Scheduler(Engine):
    """The paged engine. A step takes every decoding request's next token, then prefill chunks of
    admitted requests, then newly admitted ones, up to token_budget tokens in all."""

    def __init__(self, model, num_blocks, block_size=16, token_budget=512, max_batch=64, prefix_cache=True,
                 num_tokens=None, clock=None, compile="auto"):
        super().__init__(model, max_batch, num_tokens, clock)
        if min(block_size, token_budget, num_blocks) < 1 or compile not in ("auto", "on", "off"):
            raise ValueError(f"block_size {block_size}, token_budget {token_budget}, num_blocks {num_blocks} must "
                             f"be >= 1, compile {compile!r} auto, on or off")
        c = model.config  # the pool, allocated once; (layer, head)'s own is k_pool[layer, :, :, head]
        # NOTE: one block more than the allocator hands out: the last is padding's, to read and write harmlessly
        shape = (c.n_layer, num_blocks + 1, block_size, c.n_head, c.n_embd // c.n_head)
        self.k_pool = torch.zeros(shape, device=self.device, dtype=model.lm_head.weight.dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size, self.token_budget, self.prefix_cache = block_size, token_budget, prefix_cache
        # auto: compiled decode attention on a GPU, and on a CPU from 16 decode rows: as fast there or faster
        self.compile, self.compile_from = compile, 1 if compile == "on" or self.k_pool.is_cuda else 16
        self.max_running = min(max_batch, token_budget)  # so every decoding sequence fits in a step
        self.watermark = max(1, num_blocks // 100)  # kept free at admission, for running requests to grow
        self.admitted_tokens = self.cached_tokens = 0  # over every admission, readmissions included
        # each running request's block table in its row, updated as it grows: no step rebuilds one from a list
        shape, pinned = (max_batch, self.blocks_for(self.context)), self.k_pool.is_cuda
        self.block_tables = torch.full(shape, num_blocks, dtype=torch.int32, pin_memory=pinned)

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def check(self, r):
        super().check(r)
        need = self.blocks_for(r.num_prompt + r.max_new_tokens - 1)  # the last token is never fed back
        if need * r.num_beams > self.allocator.num_blocks:  # a preempted beam group comes back whole
            each = f" for each of {r.num_beams} beams" if r.num_beams > 1 else ""
            raise ValueError(f"a request of {r.num_prompt} + {r.max_new_tokens} tokens needs {need} blocks of "
                             f"{self.block_size}{each}, but the pool has only {self.allocator.num_blocks}")

    def schedule(self):
        budget, plan = self.token_budget, []
        for r in list(self.running):  # oldest first, so preemption takes the newest
            if r.status == "decoding" and r.logprobs is None and self.reserve_slot(r):
                plan.append((r, 1))
                budget -= 1
        plan = [(r, n) for r, n in plan if r.row is not None]  # a beam group goes whole: some may have gone
        prefilling = [r for r in self.running if r.status == "prefilling"]
        while self.waiting and budget > sum(len(r.tokens) - r.num_computed for r in prefilling):
            admitted = self.admit(self.waiting[0])
            if not admitted:
                break
            prefilling += admitted
        for r in prefilling:  # chunks in admission order until the budget runs out
            if budget > 0:
                plan.append((r, min(len(r.tokens) - r.num_computed, budget)))
                budget -= plan[-1][1]
        return plan

    def reserve_slot(self, r):
        """Give r's next token a slot of its own: a new block when its last is full, a copy of its last when
        that is shared with a fork (copy-on-write; full blocks are never written, so never copied). If no
        block is free even after evicting cached ones, preempt the newest running request (its whole beam
        group), r itself included. False if r was preempted."""
        k = r.num_computed // self.block_size
        if k < len(r.block_table) and self.allocator.ref_count[r.block_table[k]] == 1:
            return True
        while self.allocator.num_free() == 0:
            group = self.group_of(self.running[-1])
            for victim in reversed(group):
                self.preempt(victim)
            if r in group:
                return False
        block = self.allocator.allocate_one()
        if k < len(r.block_table):  # copy the shared block's K/V in every layer, then let go of it
            shared = r.block_table[k]
            self.k_pool[:, block], self.v_pool[:, block] = self.k_pool[:, shared], self.v_pool[:, shared]
            self.allocator.free([shared])
            r.block_table[k] = block
        else:
            r.block_table.append(block)
        self.block_tables[r.row, k] = block
        return True

    def group_of(self, r):  # what preemption takes with r: a beam group needs all its beams to step
        return [s for s in self.running if s.root is r.root] if r.num_beams > 1 else [r]

    def preempt(self, r):
        """Free r's blocks (hashed ones stay cached) and requeue it first. It keeps its tokens and
        recomputes their K/V when readmitted."""
        self.stop(r, "waiting")
        r.num_computed = 0
        self.waiting.appendleft(r)
        self.num_preemptions += 1

    def admit(self, r):
        """Admit r (with the rest of its beam group, if preempted as one) if free blocks cover its tokens,
        less those the prefix cache holds, and the copies its forks will make of a shared last block, and
        leave the watermark. -> the admitted; none if r waits, and so does everyone behind it."""
        group = list(itertools.takewhile(lambda s: s.root is r.root, self.waiting)) if r.num_beams > 1 else [r]
        if sum(s.width() for s in self.running + group) > self.max_running:
            return []
        hits = [self.cached_prefix(s) if self.prefix_cache else [] for s in group]
        if len(group) == 1 and self.prefix_cache and self.prefix_in_flight(r, len(hits[0])):
            return []  # a running request is computing this prefix's next block: wait and share it
        new_blocks = [self.blocks_for(len(s.tokens)) - len(h) for s, h in zip(group, hits)]
        revived = {b for h in hits for b in h if self.allocator.ref_count[b] == 0}  # free cached hits count
        copies = (r.width() - 1) * (len(r.tokens) % self.block_size > 0)  # alone, its forks may preempt each other
        if sum(new_blocks) + len(revived) + (copies + self.watermark) * bool(self.running) > self.allocator.num_free():
            return []
        for s, h, n in zip(group, hits, new_blocks):
            for block in h:
                self.allocator.share(block)
            s.block_table = h + self.allocator.allocate_n(n)
            s.num_computed = len(h) * self.block_size
            self.admitted_tokens += len(s.tokens)
            self.cached_tokens += s.num_computed
            self.waiting.popleft()
            self.start(s)
            self.block_tables[s.row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        return group

    def block_tokens(self, r, k):
        return tuple(r.tokens[k * self.block_size : (k + 1) * self.block_size])

    def block_hash(self, r, k):
        """Chained: block k's hash covers block k-1's, so a hit on block k means blocks 0..k all match."""
        while len(r.block_hashes) <= k:
            parent = r.block_hashes[-1] if r.block_hashes else b""
            tokens = array("q", self.block_tokens(r, len(r.block_hashes))).tobytes()
            r.block_hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
        return r.block_hashes[k]

    def cached_prefix(self, r):
        """The longest run of cached full blocks heading r's tokens, leaving at least the last token to
        compute: its logits start generation."""
        hits = []
        for k in range((len(r.tokens) - 1) // self.block_size):
            block = self.allocator.lookup(self.block_hash(r, k), self.block_tokens(r, k))
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_in_flight(self, r, k):
        """Is a prefilling request computing block k of the same prefix right now?"""
        if k >= (len(r.tokens) - 1) // self.block_size:
            return False
        h, full = self.block_hash(r, k), (k + 1) * self.block_size
        return any(o.status == "prefilling" and o.num_computed < full <= len(o.tokens) and self.block_hash(o, k) == h
                   for o in self.running)

    def computed(self, r, n):
        if self.prefix_cache:  # register the blocks that just filled
            for k in range((r.num_computed - n) // self.block_size, r.num_computed // self.block_size):
                self.allocator.register(r.block_table[k], self.block_hash(r, k), self.block_tokens(r, k))

    def forked(self, r, child):
        for block in r.block_table:
            self.allocator.share(block)
        self.block_tables[child.row] = self.block_tables[r.row]

    def make_batch(self, plan, ready, tokens):
        compiled = self.compile != "off" and sum(n == 1 for _, n in plan) >= self.compile_from
        rows, starts = [r.row for r, _ in plan], [r.num_computed for r, _ in plan]
        lens = [n for _, n in plan]
        return PagedBatch(self.k_pool, self.v_pool, self.block_tables, tokens, rows, starts, lens, ready, compiled)

    def release(self, r):
        self.allocator.free(r.block_table)
        r.block_table = []

    def kv_slots(self):
        allocated = (self.allocator.num_blocks - self.allocator.num_free()) * self.block_size
        shared_again = self.allocator.num_extra_holds * self.block_size  # counted by each extra holder
        # forks share a partly filled last block until they write: its extra holders counted its empty slots too
        bs, ref_count = self.block_size, self.allocator.ref_count
        partial = {r.block_table[-1]: r.num_computed % bs for r in self.running if r.num_computed % bs}
        shared_again -= sum((ref_count[b] - 1) * (bs - n) for b, n in partial.items())
        # admission allocates a whole prompt's blocks; those past its computed tokens are held ahead
        ahead = sum(len(r.block_table) - self.blocks_for(r.num_computed) for r in self.running) * self.block_size
        return dict(allocated=allocated, used=sum(r.num_computed for r in self.running) - shared_again, ahead=ahead)
