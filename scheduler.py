"""The paged engine's policy: what each step runs, who is admitted, and who is preempted. A step takes every
decoding sequence's next token, then prefill chunks of admitted sequences, then newly admitted ones, up to
token_budget tokens in all. Admission waits until free blocks cover a sequence (backpressure); a full pool
preempts the newest sequence, to be recomputed, or swapped out to a swap space in host memory and back in.
K/V live in the block pool (paged.py)."""

import torch

from engine import Engine, PlanEntry
from paged import BlockAllocator, PagedBatch, allocate_pool, blocks_for
from sequence import SequenceStatus

# compile "auto" on a CPU: compiled decode attention from this many rows, as fast or faster (docs/compile.md)
COMPILE_FROM_ROWS = 16
COMPILE_MODES = ("auto", "on", "off", "graph")


class PagedEngine(Engine):
    """K/V in a pool of num_blocks blocks of block_size tokens, shared through the prefix cache and by forks,
    copied on write."""

    def __init__(
        self,
        model,
        *,
        num_blocks,
        block_size=16,
        token_budget=512,
        max_batch=64,
        prefix_cache=True,
        compile="auto",
        swap_blocks=0,
        **kw,
    ):
        super().__init__(model, max_batch=max_batch, **kw)  # and vocab_size, clock
        if min(block_size, token_budget, num_blocks, swap_blocks + 1) < 1 or compile not in COMPILE_MODES:
            why = f"block_size {block_size}, token_budget {token_budget}, num_blocks {num_blocks} must be >= 1"
            raise ValueError(f"{why}, swap_blocks {swap_blocks} >= 0, compile {compile!r} one of {COMPILE_MODES}")
        self.block_size = block_size
        self.token_budget = token_budget
        self.prefix_cache = prefix_cache
        self.compile = "graph" if compile == "auto" and self.device.type == "cuda" else compile
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.kv_pool = allocate_pool(model.config, num_blocks, block_size, self.device, model.lm_head.weight.dtype)
        self.k_pool, self.v_pool = self.kv_pool
        # auto: compiled decode attention on a GPU, and on a CPU from COMPILE_FROM_ROWS rows
        self.compile_from = 1 if compile == "on" or self.k_pool.is_cuda else COMPILE_FROM_ROWS
        self.max_running = min(max_batch, token_budget)  # so every decoding sequence fits in a step
        # 1% of the blocks are kept free at admission, for running sequences to grow, as vLLM V0's
        # BlockSpaceManager(watermark=0.01)
        self.watermark = max(1, num_blocks // 100)
        # each running sequence's block table in its row, updated as it grows: no step rebuilds one from a list
        width = blocks_for(self.window, block_size)
        self.block_tables = torch.full((max_batch, width), num_blocks, dtype=torch.int32)  # num_blocks: padding
        # preemption swaps K/V out to swap_blocks blocks of the pool's shape in host memory (- 1: no padding block),
        # pinned on a GPU for fast copies; with none, it drops them, to be recomputed
        self.swap_space = allocate_pool(
            model.config, swap_blocks - 1, block_size, "cpu", self.kv_pool.dtype, self.kv_pool.is_cuda
        )
        self.free_swap = list(range(swap_blocks))  # a stack, as the allocator's clean blocks
        self.prepare_graphs()

    def check(self, r):
        super().check(r)
        need = blocks_for(len(r.prompt) + r.max_new_tokens - 1, self.block_size)  # the last token is never fed back
        if need * r.params.num_beams > self.allocator.num_blocks:  # a preempted beam group comes back whole
            why = f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens needs {need} blocks of {self.block_size}"
            each = f" for each of {r.params.num_beams} beams" if r.params.num_beams > 1 else ""
            raise ValueError(f"{why}{each}, but the pool has only {self.allocator.num_blocks}")

    def schedule(self):
        """The step's plan: decodes first, then prefill chunks in admission order until the budget runs out."""
        plan = self.schedule_decodes()
        budget = self.token_budget - len(plan)
        prefilling = [s for s in self.running if s.status is SequenceStatus.PREFILLING]
        while self.waiting and budget > sum(s.num_uncomputed() for s in prefilling):
            admitted = self.admit_next()
            if not admitted:
                break
            prefilling += admitted
        for s in prefilling:
            if budget > 0:
                n = min(s.num_uncomputed(), budget)
                plan.append(PlanEntry(s, n))
                budget -= n
        return plan

    def schedule_decodes(self):
        """A slot for each decoding sequence's next token, in the order they started, so that preemption takes
        the newest started. A reservation may preempt: a victim that has not reserved yet loses its row before
        its turn, and one that has (a beam-group mate of a victim) leaves the plan."""
        # a beam holding logprobs waits for its group: a readmitted group's prefills can end in different steps
        decoding = [s for s in self.running if s.status is SequenceStatus.DECODING and s.logprobs is None]
        for s in decoding:
            if s.row is not None:
                self.reserve_slot(s)
        return [PlanEntry(s, 1) for s in decoding if s.row is not None]

    def reserve_slot(self, s):
        """Give s's next token a slot of its own: a new block when its last is full, a copy of its last when
        another holds it too (copy-on-write: shared blocks are never written). May preempt s itself."""
        k = s.num_computed // self.block_size  # the block its next token goes in
        if k < len(s.block_table) and self.allocator.ref_count[s.block_table[k]] == 1:  # held alone: written in place
            return
        if not self.make_room(s):
            return
        [block] = self.allocator.allocate(1)
        if k < len(s.block_table):
            self.copy_on_write(s, k, block)
        else:
            s.block_table.append(block)
        self.block_tables[s.row, k] = block

    def make_room(self, s):
        """Preempt the newest running sequences until one block can be allocated (a free cached block counts:
        allocate evicts it) -> whether s still runs."""
        while not self.allocator.can_allocate(1):
            victims = self.beam_group(self.running[-1], self.running)  # a beam needs all its group to step
            self.preempt(victims)
            if s in victims:
                return False
        return True

    def beam_group(self, s, sequences):
        """s, with the rest of its beam group among `sequences`, in their order."""
        if s.request.params.num_beams == 1:
            return [s]
        return [x for x in sequences if x.request is s.request]

    def copy_on_write(self, s, k, block):
        """s's block k is shared: copy its K/V into `block`, which s holds alone from now on."""
        shared = s.block_table[k]
        self.kv_pool[:, :, block] = self.kv_pool[:, :, shared]
        self.allocator.free([shared])
        s.block_table[k] = block
        self.notify("copied", block)

    def preempt(self, group):
        """Stop the group and requeue it first, each sequence's K/V copied to the swap space in one indexed copy,
        or, with no swap space or one that cannot take them all, dropped (hashed blocks stay cached), to be
        recomputed when readmitted. Blocks it shares with others stay where they are, with them."""
        for s in group:  # a beam that held its logprobs computes its last token again, for them
            s.num_computed = min(s.num_computed, len(s.tokens) - 1)
        swap = sum(blocks_for(s.num_computed, self.block_size) for s in group) <= len(self.free_swap)  # else dropped
        for s in reversed(group):
            if swap:
                self.notify("swapping")
                s.swapped = [self.free_swap.pop() for _ in range(blocks_for(s.num_computed, self.block_size))]
                self.swap_space[:, :, s.swapped] = self.kv_pool[:, :, s.block_table[: len(s.swapped)]].cpu()
            else:
                s.num_computed = 0
            self.stop(s, SequenceStatus.WAITING)
            self.waiting.appendleft(s)
            self.notify("preempted", s)

    def swap_in(self, s, cached):
        """s's K/V back from the swap space into new blocks, in one indexed copy, after its prefix-cache hits
        (already shared: blocks it shared before it was swapped out, if they are still cached) -> its blocks."""
        rest = s.swapped[len(cached) :]
        blocks = self.allocator.allocate(len(rest))
        self.notify("swapping")
        self.kv_pool[:, :, blocks] = self.swap_space[:, :, rest].to(self.device)
        self.free_swap += s.swapped
        s.swapped = []
        self.notify("swapped_in", s, len(blocks))
        return cached + blocks

    def admit_next(self):
        """Admit the head of the waiting queue, with its beam group, if rows and blocks allow -> the admitted,
        or none: then it waits, and so does everyone behind it."""
        group = self.beam_group(self.waiting[0], self.waiting)  # NOTE: a preempted group waits whole, first
        if sum(x.num_rows() for x in self.running + group) > self.max_running:
            return []
        hits = [self.allocator.cached_prefix(x) if self.prefix_cache else [] for x in group]
        if not self.has_blocks_for(group, hits):
            return []
        # NOTE: every hit is shared before any member allocates, which could evict a free cached block
        # that another member of the group is about to share
        for cached in hits:
            for block in cached:
                self.allocator.share(block)
        for s, cached in zip(group, hits):
            self.waiting.popleft()  # the group heads the queue
            self.admit(s, cached)
        self.notify("admitted", group)
        return group

    def has_blocks_for(self, group, hits):
        """Whether free blocks cover the group's tokens less the cached ones, and its forks' copies of a shared
        last block, and leave the watermark. Not while another sequence is computing a lone sequence's next
        prefix block: it waits, and shares that block next step."""
        s = group[0]
        # a lone sequence only: a group is a preempted beam group, which comes back whole and first
        if len(group) == 1 and self.prefix_cache and self.prefix_in_flight(s, len(hits[0])):
            return False  # a running sequence is computing this prefix's next block: wait and share it
        need = sum(blocks_for(len(x.tokens), self.block_size) - len(h) for x, h in zip(group, hits))
        revived = {block for h in hits for block in h if self.allocator.ref_count[block] == 0}
        need += len(revived)  # a free cached hit leaves the free blocks
        if self.running:  # alone, a sequence may take the watermark, and its forks may preempt each other
            # the forks of its prompt each copy its last block, if partly filled, on their first write
            copies = s.num_rows() - 1 if len(s.tokens) % self.block_size else 0
            need += self.watermark + copies
        return self.allocator.can_allocate(need)

    def prefix_in_flight(self, s, k):
        """Is a prefilling sequence computing block k of s's prefix right now?"""
        if k >= (len(s.tokens) - 1) // self.block_size:
            return False
        block_hash = self.allocator.block_hash(s, k)
        end = (k + 1) * self.block_size
        computing = [x for x in self.running if x.status is SequenceStatus.PREFILLING and x.num_computed < end]
        return any(end <= len(x.tokens) and self.allocator.block_hash(x, k) == block_hash for x in computing)

    def admit(self, s, cached):
        """s starts with the cached blocks heading its tokens, already shared, then, if it was swapped out, the
        rest of its K/V copied back, and new blocks for the rest of its tokens."""
        s.num_computed = max(s.num_computed, len(cached) * self.block_size)  # swapped out, it kept its count
        if s.swapped:
            cached = self.swap_in(s, cached)
        num_new = blocks_for(len(s.tokens), self.block_size) - len(cached)
        s.block_table = cached + self.allocator.allocate(num_new)
        self.start(s)
        self.block_tables[s.row, : len(s.block_table)] = torch.tensor(s.block_table)  # int64 ids, stored as int32

    def make_batch(self, plan, samplers):
        num_one_token = sum(n == 1 for _, n in plan)
        compiled = self.compile != "off" and num_one_token >= self.compile_from
        decode_only = len(samplers) <= len(plan) == num_one_token
        shape = self.graph_shape(len(plan)) if self.compile == "graph" and decode_only else None  # pad to a graph's
        return PagedBatch(plan, samplers, self.staging, self.k_pool, self.v_pool, self.block_tables, compiled, shape)

    def graph_shape(self, num_rows):
        """The smallest captured batch that holds num_rows rows, each reading as many blocks as the longest context
        has: narrower tables, in graphs of their own, ran no faster end to end on an H200 (docs/gpu.md)."""
        return next(b for b in self.graph_batches if b >= num_rows), self.block_tables.shape[1]

    @torch.no_grad()
    def prepare_graphs(self):
        """The batch buckets a decode-only step is padded to with compile graph: 1, 2, 4, 8, then steps of 16. On
        CUDA, one graph per bucket, captured largest first in one memory pool, as nano-vllm's capture_cudagraph: a
        decode-only step replays its bucket's graph instead of launching every kernel from Python."""
        buckets = [1, 2, 4, 8, *range(16, self.max_running, 16)]
        self.graph_batches = [b for b in buckets if b < self.max_running] + [self.max_running]
        self.graphs = {}  # (batch, width) -> (its CUDA graph, the logits it writes)
        if self.compile != "graph" or self.device.type != "cuda":
            return
        pool = None
        for shape in map(self.graph_shape, reversed(self.graph_batches)):
            batch = PagedBatch([], [], self.staging, self.k_pool, self.v_pool, self.block_tables, True, shape)
            self.forward(batch)  # warm-up: compiles and allocates outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(batch)
            pool = graph.pool()
            self.graphs[shape] = (graph, logits)

    def forward(self, batch):
        if batch.padded_shape not in self.graphs:  # no graph of this shape: launch the forward's kernels one by one
            return super().forward(batch)
        graph, logits = self.graphs[batch.padded_shape]
        graph.replay()
        return logits

    def mark_computed(self, plan):
        super().mark_computed(plan)
        if self.prefix_cache:  # the blocks that just filled join the prefix cache
            for s, n in plan:
                if s.num_computed % self.block_size < n:  # a block filled: not so for most decodes
                    self.allocator.register_filled(s, s.num_computed - n)

    def fork_kv(self, parent, child):
        for block in parent.block_table:
            self.allocator.share(block)
        child.block_table = parent.block_table[:]
        child.num_computed = parent.num_computed
        self.block_tables[child.row] = self.block_tables[parent.row]

    def release(self, s):
        self.allocator.free(s.block_table)
        s.block_table = []
