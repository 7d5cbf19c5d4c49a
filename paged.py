"""The paged KV cache: the block allocator, write and gather on the pool, and the step batches a forward
reads and writes through. The pool, k and v: (n_layer, num_blocks + 1, block_size, n_head, head_size), is
block-major: a gather copies whole blocks; (layer, head)'s own pool is k[layer, :, :, head]. Position p
of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size of k[layer]."""

from collections import OrderedDict

import torch
import torch.nn.functional as F

from model import attend


class BlockAllocator:
    """Clean blocks sit on a LIFO stack: the most recently freed goes out first. A block may have several
    holders (ref_count); a full one, hashed, stays cached after its last holder lets go, and is evicted least
    recently released first, only when no clean block is left.
    NOTE: the pool's last block, padding_block, is never handed out: padded rows read and write it harmlessly."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.padding_block = num_blocks
        self.clean = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 goes out first
        self.cached = OrderedDict()  # free blocks still holding cached K/V, oldest release first
        self.ref_count = [0] * num_blocks
        self.hash_of = {}  # block -> hash of its content, prefix included
        self.cache = {}  # hash -> (block, its token ids): the prefix cache

    def num_free(self):
        return len(self.clean) + len(self.cached)

    def can_allocate(self, n):
        return n <= self.num_free()

    def allocate(self, n=1):
        if not self.can_allocate(n):
            raise RuntimeError(f"KV pool exhausted: {n} blocks asked, {self.num_free()} of {self.num_blocks} free")
        blocks = [self.clean.pop() for _ in range(min(n, len(self.clean)))]
        while len(blocks) < n:  # no clean block left: evict the least recently released cached one
            block, _ = self.cached.popitem(last=False)
            del self.cache[self.hash_of.pop(block)]
            blocks.append(block)
        for block in blocks:
            self.ref_count[block] = 1
        return blocks

    def free(self, blocks):
        """Drop one hold on each block, tail first, so shared heads are the last to be evicted."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] > 0:
                continue
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.clean.append(block)

    def is_shared(self, block):  # a block with other holders is never written: its writer copies it first
        return self.ref_count[block] > 1

    def share(self, block):
        if self.ref_count[block] == 0:
            del self.cached[block]
        self.ref_count[block] += 1

    def lookup(self, block_hash, tokens):
        """The cached block with this hash, if it really holds these tokens: a collision never hits."""
        hit = self.cache.get(block_hash)
        return hit[0] if hit is not None and hit[1] == tokens else None

    def register(self, block, block_hash, tokens):
        if block_hash not in self.cache and block not in self.hash_of:
            self.cache[block_hash] = (block, tokens)
            self.hash_of[block] = block_hash


def write_kv(k_pool, v_pool, slots, k, v):
    """One layer's new K/V, all sequences and heads, into their slots in one indexed copy each.
    k_pool, v_pool: (num_blocks + 1, block_size, H, D); slots: (N,); k, v: (N, H, D)."""
    H, D = k.shape[1:]
    k_pool.view(-1, H, D).index_copy_(0, slots, k)
    v_pool.view(-1, H, D).index_copy_(0, slots, v)


def gather_kv(pool, block_table):
    """pool: (num_blocks + 1, block_size, H, D), block_table: (B, W) -> (B, W * block_size, H, D): one
    index_select of whole blocks, each a contiguous copy."""
    B, W = block_table.shape
    return pool.index_select(0, block_table.flatten()).view(B, W * pool.shape[1], *pool.shape[2:])


def gather_attend(q, k_pool, v_pool, block_table, kv_len):
    """Decode attention straight from the pool: q (B, H, D), block_table (B, W), kv_len (B,) -> (B, H, D).
    Products and sums, so that torch.compile fuses the block gather, and bf16's conversion to float32, into
    the reductions: the pool is read in place, never copied (tests/test_bf16.py)."""
    B, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays exact
    scores = (q[:, None, None].to(acc) * k_pool[block_table].to(acc)).sum(-1).view(B, -1, H) * D**-0.5  # (B, L, H)
    visible = torch.arange(scores.shape[1], device=q.device) < kv_len[:, None]  # (B, L)
    p = scores.masked_fill(~visible[..., None], float("-inf")).softmax(1)
    return (p[..., None] * v_pool[block_table].to(acc).view(B, -1, H, D)).sum(1).to(q.dtype)


class StepBatch:
    """Where one forward's new tokens sit. Entry i of the plan, (sequence, n), brings n new tokens after its
    num_computed cached ones; one-token entries (decode) come first and attend together in one call, then each
    prefill chunk alone. samplers: (entry, sequence) for each sequence whose next token is due, read from the
    entry's last token (forks of a prompt share its entry). Built on the host, copied to the device at once by
    stage(): idx, positions (N,): the new tokens and their positions; logit_rows, sample_rows, sample_pos (S,):
    the token whose logits each sampler reads, the sampler's row, and the position of the token it samples."""

    def __init__(self, plan, samplers):
        starts, lens = [s.num_computed for s, _ in plan], [n for _, n in plan]
        tokens = torch.tensor([t for s, n in plan for t in s.tokens[s.num_computed : s.num_computed + n]])
        R, N, S = len(lens), sum(lens), sum(n == 1 for n in lens)
        assert all(n == 1 for n in lens[:S]), "one-token entries must come first"
        lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)  # (R,) each
        ends = lens_t.cumsum(0)
        self.entry = torch.repeat_interleave(torch.arange(R), lens_t)  # (N,) plan entry of each token
        self.positions_cpu = starts_t[self.entry] + torch.arange(N) - (ends - lens_t)[self.entry]  # (N,)
        self.kv_lens = starts_t + lens_t  # (R,) keys each entry has after this step
        self.num_decode = S
        self.spans = [(end - n, end) for n, end in zip(lens, ends.tolist())]  # each entry's tokens in the step
        self.chunks = [(i, *self.spans[i], starts[i]) for i in range(S, R)]
        entries = torch.tensor([i for i, _ in samplers], dtype=torch.long)
        rows = torch.tensor([s.row for _, s in samplers], dtype=torch.long)
        self.host = [tokens, self.positions_cpu, (ends - 1)[entries], rows, self.kv_lens[entries]]

    def stage(self, device, *more):
        """One host-to-device copy for every small tensor of the step -> each as a view of it on the device."""
        parts = self.host + list(more)
        flat = torch.cat([t.flatten().long() for t in parts])
        if device.type == "cuda":
            flat = flat.pin_memory()  # from pinned memory the copy runs async; the step's end waits for it
        flat = flat.to(device, non_blocking=True)
        views = [piece.view(t.shape) for t, piece in zip(parts, flat.split([t.numel() for t in parts]))]
        self.idx, self.positions, self.logit_rows, self.sample_rows, self.sample_pos = views[:5]
        return views[5:]

    def store(self, layer, k, v):  # hook: keep one layer's new K/V, k, v: (N, H, D)
        raise NotImplementedError

    def attend_decode(self, layer, q):  # hook: q (S, H, D) -> (S, H, D), the decode entries' attention
        raise NotImplementedError

    def chunk_kv(self, layer, i):  # hook: the keys and values entry i's chunk attends, its own too: (1, L, H, D)
        raise NotImplementedError

    def attend(self, layer, q, k, v):
        """q, k, v: (N, H, D) for the step's new tokens -> (N, H, D)."""
        self.store(layer, k, v)
        S = self.num_decode
        out = [self.attend_decode(layer, q[:S])] if S else []
        for i, a, b, start in self.chunks:
            if start == 0:  # a fresh chunk sees only itself: causal attention over its own new K/V
                qc, kc, vc = (t[None, a:b].transpose(1, 2) for t in (q, k, v))  # (1, H, n, D): CPU flash needs 4-D
                out.append(F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)[0].transpose(0, 1))
            else:  # a chunk after cached tokens reads them back
                keys, values = self.chunk_kv(layer, i)
                out.append(attend(q[None, a:b], keys, values, self.positions[None, a:b])[0])
        return torch.cat(out) if len(out) > 1 else out[0]


class PagedBatch(StepBatch):
    """The pool seen by one forward, through tables cut from the engine's block_tables (max_batch, W) by row:
    slots (N,): where each new token's K/V go; table (R, W): each entry's blocks; decode_table (B, W'),
    decode_len (B,): the decode entries'. compiled: decode attention through torch.compile(gather_attend)."""

    compiled_fn = None  # torch.compile(gather_attend), built on first use

    def __init__(self, plan, samplers, k_pool, v_pool, block_tables, padding_block, compiled):
        super().__init__(plan, samplers)
        self.k_pool, self.v_pool, self.compiled = k_pool, v_pool, compiled
        bs, S = k_pool.shape[2], self.num_decode
        self.blocks_read = (self.kv_lens + bs - 1) // bs  # (R,)
        table = block_tables[torch.tensor([s.row for s, _ in plan]), : int(self.blocks_read.max())].long()  # (R, W)
        slots = table[self.entry, self.positions_cpu // bs] * bs + self.positions_cpu % bs  # (N,)
        decode_table, decode_len = table[:S, : int(self.blocks_read[:S].max()) if S else 0], self.kv_lens[:S]
        if compiled and S:  # sizes of 1 would specialize the graph: pad to 2 with the padding block
            B, W = max(S, 2), max(decode_table.shape[1], 2)
            decode_table = F.pad(decode_table, (0, W - decode_table.shape[1], 0, B - S), value=padding_block)
            decode_len = F.pad(decode_len, (0, B - S), value=1)
        views = self.stage(k_pool.device, slots, table, decode_table, decode_len)
        self.slots, self.table, self.decode_table, self.decode_len = views
        self.blocks_read = self.blocks_read.tolist()

    def store(self, layer, k, v):
        write_kv(self.k_pool[layer], self.v_pool[layer], self.slots, k, v)

    def attend_decode(self, layer, q):
        k_pool, v_pool, table, kv_len = self.k_pool[layer], self.v_pool[layer], self.decode_table, self.decode_len
        if not self.compiled:  # copy whole blocks out, then SDPA
            k, v = gather_kv(k_pool, table), gather_kv(v_pool, table)  # (S, L, H, D)
            return attend(q[:, None], k, v, kv_len[:, None] - 1)[:, 0]
        if PagedBatch.compiled_fn is None:  # one graph per dtype, far below dynamo's recompile limit (8)
            PagedBatch.compiled_fn = torch.compile(gather_attend)
        padded = F.pad(q, (0, 0, 0, 0, 0, table.shape[0] - q.shape[0]))  # (B, H, D)
        for t, dim in [(padded, 0), (table, 0), (table, 1), (kv_len, 0), (k_pool, 0), (v_pool, 0)]:
            torch._dynamo.maybe_mark_dynamic(t, dim)  # one graph for every batch, width and pool size
        return PagedBatch.compiled_fn(padded, k_pool, v_pool, table, kv_len)[: q.shape[0]]

    def chunk_kv(self, layer, i):
        table = self.table[i : i + 1, : self.blocks_read[i]]
        return gather_kv(self.k_pool[layer], table), gather_kv(self.v_pool[layer], table)
