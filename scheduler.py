"""The paged engine's policy: what each step runs, who is admitted, and who is preempted. A step takes every
decoding sequence's next token, then prefill chunks of admitted sequences, then newly admitted ones, up to
token_budget tokens in all. Admission waits until free blocks cover a sequence (backpressure); a full pool
preempts the newest sequence, to be recomputed when it is readmitted. K/V live in the block pool (paged.py)."""

import numpy as np

from engine import Engine, PlanEntry
from paged import BlockAllocator, PagedBatch, allocate_pool, blocks_for
from sequence import SequenceStatus


class PagedEngine(Engine):
    """K/V in a pool of num_blocks blocks of block_size tokens, full blocks shared through the prefix cache.
    It changes nothing outside itself: on a CPU, harness.tuning.prepare(model) packs the model's linears for oneDNN and
    sets the process's allocator first (example.py), which the command line does too."""

    batch_class = PagedBatch  # the CUDA extension's stages each step in one copy (ext/cuda.py)
    # an extension that adds a mode adds it here: "graph" (ext/cuda.py), "step" (ext/compiled_steps.py), "kernel"
    # (ext/cpu_kernel.py)
    compile_modes = ("auto", "on", "off")

    def __init__(self, model, *, num_blocks, block_size=16, token_budget=512, prefix_cache=True, compile="auto", **kw):
        max_batch = kw.pop("max_batch", 64)
        if min(block_size, token_budget, num_blocks, max_batch) < 1 or compile not in self.compile_modes:
            why = f"block_size {block_size}, token_budget {token_budget}, num_blocks {num_blocks}"
            raise ValueError(f"{why}, max_batch {max_batch} must be >= 1, compile {compile!r} in {self.compile_modes}")
        # no more sequences than a step's tokens, so that every decoding sequence fits in a step
        super().__init__(model, max_batch=min(max_batch, token_budget), **kw)  # and vocab_size
        self.block_size = block_size
        self.token_budget = token_budget
        self.prefix_cache = prefix_cache
        self.compile = compile
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.kv_pool = allocate_pool(model.config, num_blocks, block_size, self.device, model.lm_head.weight.dtype)
        # auto (and an extension's mode, for the steps it leaves to the core): compiled decode attention on a GPU,
        # and on a CPU from 16 rows, as fast or faster from there (docs/compile.md)
        self.compile_from = 1 if compile == "on" or self.kv_pool.is_cuda else 16
        # 1% of the blocks are kept free at admission, for running sequences to grow, as vLLM V0's
        # BlockSpaceManager(watermark=0.01)
        self.watermark = max(1, num_blocks // 100)
        # each running sequence's block table in its row, updated as it grows: no step rebuilds one from a list
        width = blocks_for(self.window, block_size)
        self.block_tables = np.full((self.max_batch, width), num_blocks, dtype=np.int32)  # num_blocks: padding

    def check(self, r):
        super().check(r)
        need = self.blocks_needed(r)
        if need > self.allocator.num_blocks:
            why = f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens needs {need} blocks of {self.block_size}"
            raise ValueError(f"{why}, but the pool has only {self.allocator.num_blocks}")

    def blocks_needed(self, r):  # at its longest, every sequence it runs at once (a beam group: ext/forks.py)
        return blocks_for(len(r.prompt) + r.max_new_tokens - 1, self.block_size)  # the last token is never fed back

    def schedule(self):
        """The step's plan: decodes first, then prefill chunks in admission order until the budget runs out."""
        plan = self.schedule_decodes()
        budget = self.token_budget - sum(n for _, n in plan)
        prefilling = [s for s in self.running if s.status is SequenceStatus.PREFILLING]
        # admit while the budget outlasts the prefills, until the head of the queue must wait
        fresh = prefilling[:]
        while self.waiting and budget > sum(s.num_uncomputed() for s in prefilling):
            # NOTE: each prefill completes in this step, every layer writing its K/V before any attends: a prompt
            # admitted next shares their full blocks at once (vLLM V1 caches blocks as it schedules them)
            for s in fresh if self.prefix_cache else []:
                self.allocator.register_filled(s, s.num_computed, len(s.tokens))
            fresh = self.admit_next()
            if not fresh:
                break
            prefilling += fresh
        for s in prefilling:
            if budget > 0:
                n = min(s.num_uncomputed(), budget)
                plan.append(PlanEntry(s, n))
                budget -= n
        return sorted(plan, key=lambda e: e.num_tokens > 1)  # one-token entries first: they attend together

    def schedule_decodes(self):
        """A slot for each decoding sequence's next token, in the order they started, so that preemption takes
        the newest started. A reservation may preempt: a victim that has not reserved yet loses its row before
        its turn, and one that has leaves the plan."""
        # a sequence with no token to compute waits: a beam holding its logprobs until its group has them all
        decoding = [s for s in self.running if s.status is SequenceStatus.DECODING and s.num_uncomputed()]
        for s in decoding:
            if s.row is not None:
                self.reserve_slot(s)
        return [PlanEntry(s, 1) for s in decoding if s.row is not None]

    def reserve_slot(self, s):
        """Give s's next token a slot: a new block when its last is full (the forks extension copies a shared
        last block on write). May preempt s itself."""
        k = s.num_computed // self.block_size  # the block its next token goes in
        if k == len(s.block_table) and self.make_room(s):
            self.place_blocks(s, k, self.allocator.allocate(1))

    def place_blocks(self, s, k, blocks):
        """`blocks`, held, become s's blocks from its k-th on, in its block table and its row of block_tables."""
        s.block_table[k : k + len(blocks)] = blocks
        self.block_tables[s.row, k : k + len(blocks)] = blocks

    def make_room(self, s):
        """Preempt the newest running sequences until one block can be allocated (a free cached block counts:
        allocate evicts it) -> whether s still runs."""
        while not self.allocator.num_free():
            self.preempt(self.running[-1])
        return s.row is not None

    def preempt(self, s):
        """Stop s and requeue it first. Its K/V are dropped (its hashed blocks stay cached), to be recomputed
        when it is readmitted; the swap extension (ext/swap.py) copies them out instead (save_kv)."""
        s.num_computed = self.save_kv(s)
        self.stop(s, SequenceStatus.WAITING)
        self.waiting.appendleft(s)
        self.notify("preempted", s)

    def save_kv(self, s):  # -> how many of s's computed tokens keep their K/V while it waits: none here
        return 0

    def admit_next(self):
        """Admit the head of the waiting queue, if a row and blocks allow -> the admitted, or none: then it
        waits, and so does everyone behind it."""
        s = self.waiting[0]
        cached = self.allocator.cached_prefix(s, self.cacheable(s)) if self.prefix_cache else []
        if not self.can_admit(s, cached):
            return []
        for block in cached:
            self.allocator.share(block)
        self.waiting.popleft()
        self.admit(s, cached)
        self.notify("admitted", [s])
        return [s]

    def cacheable(self, s):  # how many of s's first tokens the prefix cache may serve (ext/logprobs.py)
        return len(s.tokens) - 1  # not the last: its logits start generation

    def can_admit(self, s, cached, copies=0):
        """Whether a row is free and free blocks cover s's tokens less the cached ones (and `copies` more),
        leaving the watermark."""
        if len(self.running) >= self.max_batch:
            return False
        return self.blocks_to_admit(s, cached) + copies <= self.spare_blocks()

    def blocks_to_admit(self, s, cached):
        """The free blocks s takes: its tokens' less the cached ones, and each cached one that is free now."""
        need = blocks_for(len(s.tokens), self.block_size) - len(cached)
        return need + sum(self.allocator.ref_count[block] == 0 for block in cached)

    def spare_blocks(self):  # free blocks above the watermark; alone, a sequence may take it
        return self.allocator.num_free() - (self.watermark if self.running else 0)

    def admit(self, s, blocks):
        """s starts with `blocks` heading its tokens, already held: its cached prefix (the swap extension's
        blocks copied back), then new blocks for the rest of its tokens."""
        s.num_computed = len(blocks) * self.block_size
        num_new = blocks_for(len(s.tokens), self.block_size) - len(blocks)
        self.start(s)
        self.place_blocks(s, 0, blocks + self.allocator.allocate(num_new))

    def make_batch(self, plan, samplers):
        compiled = self.compile != "off" and sum(n == 1 for _, n in plan) >= self.compile_from
        return self.batch_class(plan, samplers, self.device, self.kv_pool, self.block_tables, compiled)

    def mark_computed(self, plan):
        super().mark_computed(plan)
        if self.prefix_cache:  # the blocks that just filled join the prefix cache
            for s, n in plan:
                self.allocator.register_filled(s, s.num_computed - n, s.num_computed)

    def release(self, s):
        self.allocator.free(s.block_table)
        s.block_table = []
