"""Requests and the engines that serve them. Engine.step is one model forward: plan (which requests
bring how many tokens) -> batch (where their K/V go, what they read) -> forward -> sample -> bookkeeping.
Scheduler, the paged engine, plans decode plus chunked prefill under a token budget, with
backpressure, prefix caching and preemption; ContiguousEngine is the baseline it is measured against."""
import hashlib
import heapq
import itertools
import math
import time
from array import array
from collections import deque

import torch
from torch.nn.utils.rnn import pad_sequence

from model import attend
from paged import BlockAllocator, PagedBatch, StepBatch

class Request:
    def __init__(self, prompt, max_new_tokens, temperature=0.0, top_k=None, seed=0):
        self.tokens = list(prompt)  # the prompt, then each generated token
        self.num_prompt, self.max_new_tokens = len(prompt), max_new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed
        self.status = "waiting"  # -> prefilling -> decoding -> done; a preempted request waits again
        self.row = None  # while running: its row in the engine's per-request tensors
        self.block_table = []  # physical block of each logical block
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_hashes = []  # chained hash of each full block of tokens, computed once each
        self.arrival = self.first_token_at = self.done_at = None

    @property
    def generated(self):
        return self.tokens[self.num_prompt:]

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

class Clock:
    """Wall time. The engine only asks now() and sleep(), so a test can swap in a fake clock."""
    now = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)

class Engine:
    """Runs requests to completion. Subclasses choose each step's tokens (schedule) and where their
    K/V live (make_batch, release, kv_slots)."""

    def __init__(self, model, max_batch=64, num_tokens=None, clock=None):
        if max_batch < 1:
            raise ValueError(f"max_batch is {max_batch}; it must be at least 1")
        self.model, self.max_batch, self.context = model, max_batch, model.config.block_size
        # ids from num_tokens on are never sampled: nanoGPT pads GPT-2's 50,257 tokens to 50,304 ids
        self.num_tokens = num_tokens or model.config.vocab_size
        self.device = model.lm_head.weight.device
        self.clock = clock or Clock()
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

    def run(self, requests, arrivals=None):
        for r, arrival in zip(requests, arrivals or [None] * len(requests)):
            self.add(r, arrival)
        while self.arriving or self.waiting or self.running:
            self.step()
        return requests

    def start(self, r):
        r.row = self.free_rows.pop()
        top_k = r.top_k if r.top_k and r.top_k < self.num_tokens else 0  # 0: every id is a candidate
        self.temperature[r.row], self.top_k[r.row], self.seed[r.row] = r.temperature, top_k, r.seed
        r.status = "prefilling"
        self.running.append(r)

    def stop(self, r, status):  # done, or preempted
        self.running.remove(r)
        self.free_rows.append(r.row)
        self.release(r)
        r.status, r.row = status, None

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
        hot = [plan[i][0].top_k or self.num_tokens for i in ready if plan[i][0].temperature > 0]
        cuts = [k for k in hot if k < self.num_tokens]
        rows = batch.sample_rows
        new_tokens = sample(logits, self.temperature[rows], self.top_k[rows], self.seed[rows], batch.sample_pos,
                            max(cuts, default=0), len(cuts) < len(hot))
        new_tokens = new_tokens.tolist()  # the step's one device-to-host transfer
        now = self.clock.now()
        for r, n in plan:
            self.prefill_tokens += n if r.status == "prefilling" else 0
            r.num_computed += n
            self.computed(r, n)
        allocated, used, ahead = self.kv_slots()
        self.stats.append(dict(seconds=now - start, running=len(self.running), allocated=allocated, used=used,
                               ahead=ahead, context=sum(r.num_computed for r, _ in plan)))
        for i, token in zip(ready, new_tokens):
            r = plan[i][0]
            r.tokens.append(token)
            r.status, r.first_token_at = "decoding", r.first_token_at or now
            if len(r.tokens) - r.num_prompt == r.max_new_tokens:
                r.done_at = now
                self.stop(r, "done")
                self.finished.append(r)

    def computed(self, r, n):  # hook: r's K/V just grew by n tokens
        pass

class ContiguousBatch(StepBatch):
    """The baseline's cache seen by one forward: each request's K/V are its own tensors, grown by
    torch.cat every step; decode rows are padded side by side to attend in one call."""

    def __init__(self, plan, ready, tokens, device):
        super().__init__(tokens, [r.row for r, _ in plan], [r.num_computed for r, _ in plan], [n for _, n in plan], ready)
        self.requests = [r for r, _ in plan]
        self.stage(device)

    def store(self, layer, k, v):  # k, v: (N, H, D)
        for r, (a, b) in zip(self.requests, self.spans):
            r.k[layer] = torch.cat([r.k[layer], k[a:b]])
            r.v[layer] = torch.cat([r.v[layer], v[a:b]])

    def attend_single(self, layer, q):  # q: (S, H, D)
        decoding = self.requests[:self.num_single]
        k = pad_sequence([r.k[layer] for r in decoding], batch_first=True)  # (S, L, H, D)
        v = pad_sequence([r.v[layer] for r in decoding], batch_first=True)
        return attend(q[:, None], k, v, self.single_pos)[:, 0]

    def cached_kv(self, layer, i):  # request i's K/V: (1, L, H, D) each
        return self.requests[i].k[layer][None], self.requests[i].v[layer][None]

class ContiguousEngine(Engine):
    """Continuous batching without paging: up to max_batch requests run; a new one is prefilled whole
    in the same forward that decodes the others. Under a KV budget (token slots), a request is admitted
    only if its reservation fits in what is left, and holds it until it finishes, as the vLLM paper's
    baselines do: the whole context (max: FasterTransformer, Orca (Max)), prompt + max_new_tokens
    rounded up to a power of two (pow2: Orca (Pow2)), or exactly (oracle: Orca (Oracle))."""

    def __init__(self, model, max_batch=64, num_tokens=None, kv_budget=None, reserve="max", clock=None):
        super().__init__(model, max_batch, num_tokens, clock)
        if reserve not in ("max", "pow2", "oracle") or (kv_budget is not None and kv_budget < 1):
            raise ValueError(f"reserve {reserve!r} must be max, pow2 or oracle, and kv_budget {kv_budget} at least 1")
        self.kv_budget, self.reserve, self.reserved = kv_budget, reserve, 0

    def reservation(self, r):
        need = r.num_prompt + r.max_new_tokens
        return min(self.context, {"max": self.context, "pow2": 1 << (need - 1).bit_length(), "oracle": need}[self.reserve])

    def check(self, r):
        super().check(r)
        if self.kv_budget is not None and self.reservation(r) > self.kv_budget:
            raise ValueError(f"a request of {r.num_prompt} + {r.max_new_tokens} tokens reserves {self.reservation(r)} "
                             f"slots under --reserve {self.reserve}, but the KV budget is {self.kv_budget} slots")

    def fits(self, r):
        return self.kv_budget is None or self.reserved + self.reservation(r) <= self.kv_budget

    def schedule(self):
        c = self.model.config
        while self.waiting and len(self.running) < self.max_batch and self.fits(self.waiting[0]):
            r = self.waiting.popleft()
            self.reserved += self.reservation(r)
            empty = torch.empty(0, c.n_head, c.n_embd // c.n_head, device=self.device, dtype=self.model.lm_head.weight.dtype)
            r.k, r.v = [empty] * c.n_layer, [empty] * c.n_layer
            self.start(r)
        return [(r, len(r.tokens) - r.num_computed) for r in self.running]

    def make_batch(self, plan, ready, tokens):
        return ContiguousBatch(plan, ready, tokens, self.device)

    def release(self, r):
        r.k = r.v = None
        self.reserved -= self.reservation(r)

    def kv_slots(self):  # slots (allocated, holding a token's K/V, allocated ahead for tokens to come)
        used = sum(r.num_computed for r in self.running)
        allocated = used if self.kv_budget is None else self.reserved  # unbudgeted, torch.cat holds just the tokens
        return allocated, used, allocated - used

class Scheduler(Engine):
    """The paged engine. A step takes every decoding request's next token, then prefill chunks of
    admitted requests, then newly admitted ones, up to token_budget tokens in all."""

    def __init__(self, model, num_blocks, block_size=16, token_budget=512, max_batch=64, prefix_cache=True,
                 num_tokens=None, clock=None, compile="auto"):
        super().__init__(model, max_batch, num_tokens, clock)
        if min(block_size, token_budget, num_blocks) < 1 or compile not in ("auto", "on", "off"):
            raise ValueError(f"block_size {block_size}, token_budget {token_budget} and num_blocks {num_blocks} "
                             f"must each be at least 1, and compile {compile!r} auto, on or off")
        c = model.config  # the pool, allocated once; (layer, head)'s own is k_pool[layer, :, :, head]
        # NOTE: one block more than the allocator hands out: the last is padding's, to read and write harmlessly
        shape = (c.n_layer, num_blocks + 1, block_size, c.n_head, c.n_embd // c.n_head)
        self.k_pool = torch.zeros(shape, device=self.device, dtype=model.lm_head.weight.dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size, self.token_budget, self.prefix_cache = block_size, token_budget, prefix_cache
        # auto: compiled decode attention on a GPU, and on a CPU from 32 decode rows, where it measured faster
        self.compile, self.compile_from = compile, 1 if compile == "on" or self.k_pool.is_cuda else 32
        self.max_running = min(max_batch, token_budget)  # so every decoding request fits in a step
        self.watermark = max(1, num_blocks // 100)  # kept free at admission, for running requests to grow
        self.admitted_tokens = self.cached_tokens = 0  # over every admission, readmissions included
        # each running request's block table in its row, updated as it grows: no step rebuilds one from a list
        self.block_tables = torch.full((max_batch, self.blocks_for(self.context)), num_blocks, dtype=torch.int32,
                                       pin_memory=self.k_pool.is_cuda)

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def check(self, r):
        super().check(r)
        need = self.blocks_for(r.num_prompt + r.max_new_tokens - 1)  # the last token is never fed back
        if need > self.allocator.num_blocks:
            raise ValueError(f"a request of {r.num_prompt} + {r.max_new_tokens} tokens needs {need} blocks of "
                             f"{self.block_size}, but the pool has only {self.allocator.num_blocks}")

    def schedule(self):
        budget, plan = self.token_budget, []
        for r in list(self.running):  # oldest first, so preemption takes the newest
            if r.status == "decoding" and self.reserve_slot(r):
                plan.append((r, 1))
                budget -= 1
        prefilling = [r for r in self.running if r.status == "prefilling"]
        while self.waiting and budget > sum(len(r.tokens) - r.num_computed for r in prefilling):
            if not self.admit(self.waiting[0]):
                break
            prefilling.append(self.waiting.popleft())
        for r in prefilling:  # chunks in admission order until the budget runs out
            if budget > 0:
                plan.append((r, min(len(r.tokens) - r.num_computed, budget)))
                budget -= plan[-1][1]
        return plan

    def reserve_slot(self, r):
        """Give r's next token a slot. If no block is free even after evicting cached ones, preempt the
        newest running request, r itself included. False if r was preempted."""
        if r.num_computed < len(r.block_table) * self.block_size:
            return True
        while self.allocator.num_free() == 0:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False
        r.block_table.append(self.allocator.allocate_one())
        self.block_tables[r.row, len(r.block_table) - 1] = r.block_table[-1]
        return True

    def preempt(self, r):
        """Free r's blocks (hashed ones stay cached) and requeue it first. It keeps its tokens and
        recomputes their K/V when readmitted."""
        self.stop(r, "waiting")
        r.num_computed = 0
        self.waiting.appendleft(r)
        self.num_preemptions += 1

    def admit(self, r):
        """Admit r if free blocks cover its tokens, less those the prefix cache holds, and leave the
        watermark. Otherwise it waits, and so does everyone behind it."""
        if len(self.running) >= self.max_running:
            return False
        hits = self.cached_prefix(r) if self.prefix_cache else []
        if self.prefix_cache and self.prefix_in_flight(r, len(hits)):
            return False  # a running request is computing this prefix's next block: wait and share it
        new_blocks = self.blocks_for(len(r.tokens)) - len(hits)
        taken = new_blocks + sum(self.allocator.ref_count[b] == 0 for b in hits)  # free cached hits count
        if taken + (self.watermark if self.running else 0) > self.allocator.num_free():
            return False
        for block in hits:
            self.allocator.share(block)
        r.block_table = hits + self.allocator.allocate_n(new_blocks)
        r.num_computed = len(hits) * self.block_size
        self.admitted_tokens += len(r.tokens)
        self.cached_tokens += r.num_computed
        self.start(r)
        self.block_tables[r.row, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
        return True

    def block_tokens(self, r, k):
        return tuple(r.tokens[k * self.block_size:(k + 1) * self.block_size])

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

    def make_batch(self, plan, ready, tokens):
        compiled = self.compile != "off" and sum(n == 1 for _, n in plan) >= self.compile_from
        return PagedBatch(self.k_pool, self.v_pool, self.block_tables, tokens, [r.row for r, _ in plan],
                          [r.num_computed for r, _ in plan], [n for _, n in plan], ready, compiled)

    def release(self, r):
        self.allocator.free(r.block_table)
        r.block_table = []

    def kv_slots(self):
        allocated = (self.allocator.num_blocks - self.allocator.num_free()) * self.block_size
        shared_again = self.allocator.num_extra_holds * self.block_size  # counted by each extra holder
        # admission allocates a whole prompt's blocks; those past its computed tokens are held ahead
        ahead = sum(len(r.block_table) - self.blocks_for(r.num_computed) for r in self.running) * self.block_size
        return allocated, sum(r.num_computed for r in self.running) - shared_again, ahead
