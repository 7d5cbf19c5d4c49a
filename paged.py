"""The paged KV cache: the block allocator, write and gather on the pool, and the view of the pool that
one model forward reads and writes. The pool is k, v: (n_layer, num_blocks, block_size, n_head, head_size).
It is block-major, so one block's K for every head is one contiguous run and a gather copies whole blocks;
the pool of one (layer, head) is k[layer, :, :, head], of shape (num_blocks, block_size, head_size).
Position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size, a row
of k[layer].view(num_blocks * block_size, n_head, head_size)."""
from collections import OrderedDict

import torch
import torch.nn.functional as F

from model import attend

class BlockAllocator:
    """Clean blocks sit on a LIFO stack: the most recently freed goes out first. A full block in the
    prefix cache may be held by several requests (ref_count); after its last holder lets go it stays
    cached, reclaimable, and is evicted least recently released first, only when no clean block is left."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.clean = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 goes out first
        self.cached = OrderedDict()  # free blocks still holding cached K/V, oldest release first
        self.ref_count = [0] * num_blocks
        self.hash_of = {}  # block -> hash of its content, prefix included
        self.cache = {}  # hash -> (block, its token ids): the prefix cache
        self.num_extra_holds = 0  # holds beyond the first on shared blocks, so shared slots count once

    def num_free(self):
        return len(self.clean) + len(self.cached)

    def allocate_one(self):
        if self.clean:
            block = self.clean.pop()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.cache[self.hash_of.pop(block)]
        else:
            raise RuntimeError(f"KV pool exhausted: all {self.num_blocks} blocks are held")
        self.ref_count[block] = 1
        return block

    def allocate_n(self, n):
        if n > self.num_free():
            raise RuntimeError(f"KV pool exhausted: {n} blocks asked, {self.num_free()} of {self.num_blocks} free")
        return [self.allocate_one() for _ in range(n)]

    def free(self, blocks):
        """Drop one hold on each block, tail first, so shared heads are the last to be evicted."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] > 0:
                self.num_extra_holds -= 1
            elif block in self.hash_of:
                self.cached[block] = None
            else:
                self.clean.append(block)

    def lookup(self, block_hash, tokens):
        """The cached block with this hash, if it really holds these tokens: a collision never hits."""
        hit = self.cache.get(block_hash)
        return hit[0] if hit is not None and hit[1] == tokens else None

    def share(self, block):
        if self.ref_count[block] == 0:
            del self.cached[block]
        else:
            self.num_extra_holds += 1
        self.ref_count[block] += 1

    def register(self, block, block_hash, tokens):
        if block_hash not in self.cache and block not in self.hash_of:
            self.cache[block_hash] = (block, tokens)
            self.hash_of[block] = block_hash

def write_kv(k_pool, v_pool, slots, k, v):
    """One layer's new K/V, all requests and heads, into their slots in one indexed copy each.
    k_pool, v_pool: (num_blocks, block_size, H, D); slots: (N,); k, v: (N, H, D)."""
    H, D = k.shape[1:]
    k_pool.view(-1, H, D).index_copy_(0, slots, k)
    v_pool.view(-1, H, D).index_copy_(0, slots, v)

def gather_kv(pool, block_table):
    """pool: (num_blocks, block_size, H, D), block_table: (B, W) -> (B, W * block_size, H, D): one
    index_select of whole blocks, each a contiguous copy."""
    B, W = block_table.shape
    return pool.index_select(0, block_table.flatten()).view(B, W * pool.shape[1], *pool.shape[2:])

def gather_attend(q, k_pool, v_pool, block_table, kv_len):
    """Decode attention straight from the pool: q (B, H, D), block_table (B, W), kv_len (B,) -> (B, H, D).
    Products and sums, not matmuls, so torch.compile fuses the block gather into the score and value
    reductions instead of materializing a gathered copy. Padded rows (kv_len 1) are harmless."""
    B, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # bfloat16 accumulates in float32, float64 stays exact
    scores = (q[:, None, None].to(acc) * k_pool[block_table].to(acc)).sum(-1) * D ** -0.5  # (B, W, bs, H)
    scores = scores.view(B, -1, H)  # (B, L, H)
    visible = torch.arange(scores.shape[1], device=q.device) < kv_len[:, None]  # (B, L)
    p = scores.masked_fill(~visible[..., None], float("-inf")).softmax(1)
    return (p[..., None] * v_pool[block_table].to(acc).view(B, -1, H, D)).sum(1).to(q.dtype)

class StepBatch:
    """Where one forward's new tokens sit. starts[i]: tokens request i has cached; lens[i]: tokens it
    brings now; rows[i]: its row in the engine's per-request tensors. One-token requests (decode) come
    first and attend together in one call, padded to the longest of them; each prefill chunk then attends
    alone, at its own size, so no chunk pays for another. Everything is built on the host with tensor ops,
    then copied to the device at once by stage()."""

    def __init__(self, tokens, rows, starts, lens, ready):
        R, N, S = len(lens), sum(lens), sum(n == 1 for n in lens)
        assert all(n == 1 for n in lens[:S]), "one-token requests must come first"
        lens_t, starts_t, self.rows = torch.tensor(lens), torch.tensor(starts), torch.tensor(rows)  # (R,) each
        ends = lens_t.cumsum(0)
        self.row = torch.repeat_interleave(torch.arange(R), lens_t)  # (N,) request of each token
        self.positions_cpu = starts_t[self.row] + torch.arange(N) - (ends - lens_t)[self.row]  # (N,)
        self.kv_lens = starts_t + lens_t  # (R,) keys each request has after this step
        self.num_single = S
        self.spans = [(end - n, end) for n, end in zip(lens, ends.tolist())]  # each request's tokens in the step
        self.chunks = [(i, *self.spans[i], starts[i]) for i in range(S, R)]
        ready = torch.tensor(ready, dtype=torch.long)  # requests whose next token is due now
        # logit_rows: the last new token of each ready request; sample_rows, sample_pos: its row and the
        # position of the token it samples next
        self.host = dict(idx=tokens, positions=self.positions_cpu, logit_rows=(ends - 1)[ready],
                         sample_rows=self.rows[ready], sample_pos=self.kv_lens[ready], single_pos=self.kv_lens[:S, None] - 1)

    def stage(self, device):
        """One host-to-device copy for every small tensor of the step, each then a view of it."""
        parts = list(self.host.items())
        flat = torch.cat([t.flatten().long() for _, t in parts])
        if device.type == "cuda":
            flat = flat.pin_memory()  # from pinned memory the copy runs async; the step's end waits for it
        flat = flat.to(device, non_blocking=True)
        for (name, t), piece in zip(parts, flat.split([t.numel() for _, t in parts])):
            setattr(self, name, piece.view(t.shape))

    def attend(self, layer, q, k, v):
        """q, k, v: (N, H, D) for the step's new tokens -> (N, H, D)."""
        self.store(layer, k, v)
        S = self.num_single
        out = [self.attend_single(layer, q[:S])] if S else []
        for i, a, b, start in self.chunks:
            if start == 0:  # a fresh chunk sees only itself: causal attention over its own new K/V
                qc, kc, vc = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
                out.append(F.scaled_dot_product_attention(qc, kc, vc, is_causal=True).transpose(0, 1))
            else:  # a chunk after cached tokens reads them back
                keys, values = self.cached_kv(layer, i)  # (1, L, H, D)
                out.append(attend(q[None, a:b], keys, values, self.positions[None, a:b])[0])
        return torch.cat(out) if len(out) > 1 else out[0]

class PagedBatch(StepBatch):
    """The pool seen by one forward: each new token's slot, and the block tables to read through, cut
    from the engine's persistent block_tables (max_batch, max blocks per request) by the step's rows.
    compiled: decode attention through torch.compile(gather_attend) rather than gather_kv + SDPA."""

    compiled_fn = None  # torch.compile(gather_attend), built on first use

    def __init__(self, k_pool, v_pool, block_tables, tokens, rows, starts, lens, ready, compiled=False):
        super().__init__(tokens, rows, starts, lens, ready)
        self.k_pool, self.v_pool, self.compiled, bs, S = k_pool, v_pool, compiled, k_pool.shape[2], self.num_single
        self.blocks_read = (self.kv_lens + bs - 1) // bs  # (R,)
        table = block_tables[self.rows, : int(self.blocks_read.max())].long()  # (R, W)
        slots = table[self.row, self.positions_cpu // bs] * bs + self.positions_cpu % bs  # (N,)
        single_table, single_len = table[:S, : int(self.blocks_read[:S].max()) if S else 0], self.kv_lens[:S]
        if compiled and S:  # sizes of 1 would specialize the graph: pad to 2 with the pool's spare last block
            B, W = max(S, 2), max(single_table.shape[1], 2)
            single_table = F.pad(single_table, (0, W - single_table.shape[1], 0, B - S), value=k_pool.shape[1] - 1)
            single_len = F.pad(single_len, (0, B - S), value=1)
        self.host.update(slots=slots, single_table=single_table, single_len=single_len, table=table)
        self.stage(k_pool.device)
        self.blocks_read = self.blocks_read.tolist()

    def store(self, layer, k, v):
        write_kv(self.k_pool[layer], self.v_pool[layer], self.slots, k, v)

    def attend_single(self, layer, q):  # q: (S, H, D)
        k_pool, v_pool, table, kv_len = self.k_pool[layer], self.v_pool[layer], self.single_table, self.single_len
        if not self.compiled:  # copy whole blocks out, then SDPA
            k, v = gather_kv(k_pool, table), gather_kv(v_pool, table)  # (S, L, H, D)
            return attend(q[:, None], k, v, kv_len[:, None] - 1)[:, 0]
        if PagedBatch.compiled_fn is None:  # one graph per dtype, far below dynamo's recompile limit (8)
            PagedBatch.compiled_fn = torch.compile(gather_attend)
        padded = F.pad(q, (0, 0, 0, 0, 0, table.shape[0] - q.shape[0]))  # (B, H, D)
        for t, dim in [(padded, 0), (table, 0), (table, 1), (kv_len, 0), (k_pool, 0), (v_pool, 0)]:
            torch._dynamo.maybe_mark_dynamic(t, dim)  # one graph for every batch, width and pool size
        return PagedBatch.compiled_fn(padded, k_pool, v_pool, table, kv_len)[: q.shape[0]]

    def cached_kv(self, layer, i):  # request i's K/V: (1, L, H, D) each
        table = self.table[i : i + 1, : self.blocks_read[i]]
        return gather_kv(self.k_pool[layer], table), gather_kv(self.v_pool[layer], table)
