"""The paged KV cache: the block allocator with its prefix cache, the pool, write and gather on it, and the
step batch that reads and writes through it. The pool, kv_pool: (2, n_layer, num_blocks + 1, block_size,
n_head, head_size), K and V in one tensor (k_pool, v_pool its halves), is block-major: a gather copies whole
blocks; (layer, head)'s own pool is k_pool[layer, :, :, head].
Position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size of k_pool[layer]."""

import functools
import hashlib
from collections import OrderedDict

import numpy as np
import torch

from batch import StepBatch
from model import attend, visible_keys


def blocks_for(num_tokens, block_size):
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Clean blocks sit on a LIFO stack: the most recently freed goes out first. A block may have several
    holders (ref_count); a full one, hashed, stays cached after its last holder lets go, and is evicted least
    recently released first, only when no clean block is left.
    NOTE: the pool's last block, block num_blocks, is never handed out: padded rows of a step read it harmlessly."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.clean = list(reversed(range(num_blocks)))  # a stack: block 0 goes out first
        self.cached_free = OrderedDict()  # free blocks still holding hashed K/V, oldest release first
        self.ref_count = [0] * num_blocks
        self.hash_of = {}  # block -> hash of its content, prefix included
        self.by_hash = {}  # hash -> (block, its token ids): the prefix cache

    def num_free(self):
        return len(self.clean) + len(self.cached_free)

    def allocate(self, n=1):
        if n > self.num_free():  # before any block moves: a refused allocation changes nothing
            raise RuntimeError(f"KV pool exhausted: {n} blocks asked, {self.num_free()} of {self.num_blocks} free")
        blocks = [self.clean.pop() for _ in range(min(n, len(self.clean)))]
        while len(blocks) < n:  # no clean block left: evict the least recently released cached one
            block, _ = self.cached_free.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
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
                self.cached_free[block] = None
            else:
                self.clean.append(block)

    def share(self, block):
        if self.ref_count[block] == 0:
            del self.cached_free[block]
        self.ref_count[block] += 1

    # The prefix cache: a full block is found by the hash of its tokens and of every token before it.

    def block_tokens(self, s, k):
        return tuple(s.tokens[k * self.block_size : (k + 1) * self.block_size])

    def block_hash(self, s, k):
        """Chained: block k's hash covers block k-1's, so a hit on block k means blocks 0..k all match.
        Computed once per block, into s.block_hashes."""
        while len(s.block_hashes) <= k:
            parent = s.block_hashes[-1] if s.block_hashes else b""
            tokens = repr(self.block_tokens(s, len(s.block_hashes))).encode()
            s.block_hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
        return s.block_hashes[k]

    def register(self, block, block_hash, tokens):
        # NOTE: by_hash and hash_of stay one-to-one (the first block with a hash wins), so that evicting a
        # block deletes its own entry, never another block's (tests/conftest.py checks it)
        if block_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[block_hash] = (block, tokens)
            self.hash_of[block] = block_hash

    def cached_prefix(self, s, num_tokens):
        """The cached full blocks heading s's first num_tokens tokens, each found by its hash and holding s's
        tokens: a hash collision never hits."""
        hits = []
        for k in range(num_tokens // self.block_size):
            block, tokens = self.by_hash.get(self.block_hash(s, k), (None, None))
            if tokens != self.block_tokens(s, k):
                break
            hits.append(block)
        return hits

    def register_filled(self, s, start, end):
        """Enter s's full blocks among its tokens start..end into the prefix cache."""
        for k in range(start // self.block_size, end // self.block_size):
            self.register(s.block_table[k], self.block_hash(s, k), self.block_tokens(s, k))


def allocate_pool(config, num_blocks, block_size, device, dtype):
    """k_pool and v_pool in one tensor: (2, n_layer, num_blocks + 1, block_size, n_head, head_size), the last
    block padding's. One indexed copy moves blocks of both, in every layer."""
    shape = (2, config.n_layer, num_blocks + 1, block_size, config.n_head, config.n_embd // config.n_head)
    return torch.zeros(shape, device=device, dtype=dtype)


def write_kv(k_pool, v_pool, slots, k, v):
    """One layer's new K/V, all sequences and heads, into their slots in one indexed copy each.
    k_pool, v_pool: (num_blocks + 1, block_size, H, D); slots: (N,); k, v: (N, H, D)."""
    k_pool.flatten(0, 1).index_copy_(0, slots, k)  # a view of the pool: (slots, H, D)
    v_pool.flatten(0, 1).index_copy_(0, slots, v)


def gather_kv(pool, block_table):
    """pool: (num_blocks + 1, block_size, H, D), block_table: (B, W) -> (B, W * block_size, H, D): one
    index_select of whole blocks, each a contiguous copy."""
    blocks = pool.index_select(0, block_table.flatten())  # (B * W, block_size, H, D)
    return blocks.view(len(block_table), -1, *pool.shape[2:])


def gather_attend(q, k_pool, v_pool, block_table, kv_len):
    """Decode attention straight from the pool: q (B, H, D), block_table (B, W), kv_len (B,) -> (B, H, D).
    Products and sums, so that torch.compile fuses the block gather, and bf16's conversion to float32, into
    the reductions: the pool is read in place, never copied (tests/test_bf16.py)."""
    B, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays exact
    keys = k_pool[block_table].to(acc)  # (B, W, block_size, H, D)
    q = q.to(acc) * D**-0.5
    scores = (q[:, None, None] * keys).sum(-1).view(B, -1, H)  # (B, L, H)
    unseen = torch.arange(scores.shape[1], device=q.device) >= kv_len[:, None]  # (B, L): past each row's keys
    p = scores.masked_fill(unseen[..., None], float("-inf")).softmax(1)
    values = v_pool[block_table].to(acc)  # (B, W, block_size, H, D)
    # Summed within each block first: the CPU kernel then walks one block's keys per 8-float slice of a head,
    # while they sit in cache, not a whole row's (bench/decode_attention.py: 1.4-2.1x at GPT-2 small's heads).
    weighted = p.view(*values.shape[:4], 1) * values  # (B, W, block_size, H, D)
    return weighted.sum(2).sum(1).to(v_pool.dtype)


@functools.cache
def compiled_gather_attend():
    """torch.compile(gather_attend), made once: a graph per dtype, far below dynamo's recompile limit (8)."""
    return torch.compile(gather_attend)


class PagedBatch(StepBatch):
    """The pool seen by one forward, through tables cut from the engine's block_tables (max_batch, W), a host
    array, by row.
    compiled: one-token entries attend through compiled_gather_attend (from 2 rows of 2 blocks); else blocks are
    gathered, then SDPA, but for a lone row whose blocks follow each other (lone: its slots), read in place.
    On the device, besides StepBatch's:
        slots: (N,) where each new token's K/V go;
        table: (R, W) each entry's blocks;
        one_token_table: (B, W) the one-token entries' blocks, and one_token_len: (B,) their keys."""

    def __init__(self, plan, samplers, device, kv_pool, block_tables, compiled):
        super().__init__(plan, samplers, device)
        self.k_pool, self.v_pool = kv_pool
        block_size = self.k_pool.shape[2]
        blocks_read = blocks_for(self.kv_lens, block_size)  # (R,)
        table = block_tables[[s.row for s, _ in plan], : blocks_read.max(initial=0)].astype(np.int64)  # (R, W)
        block = table[self.token_entry, self.host_positions // block_size]  # (N,)
        slots = block * block_size + self.host_positions % block_size
        B = self.num_one_token
        one_token_table = table[:B, : blocks_read[:B].max(initial=0)]
        # compiled from 2 rows of 2 blocks: a size of 1 would specialize the compiled graph
        self.compiled = compiled and min(one_token_table.shape) > 1
        # NOTE: a lone row whose blocks follow each other (a lone sequence's, as the LIFO allocator hands them out)
        # reads its keys in place, exactly its own, so with no mask: a batch-1 step 1.17x as fast (docs/vllm.md)
        run = B == 1 and (np.diff(one_token_table) == 1).all()
        self.lone = slice(one_token_table[0, 0] * block_size, slots[0] + 1) if run else None
        staged = self.stage(slots, table, one_token_table, self.kv_lens[:B])
        self.slots, self.table, self.one_token_table, self.one_token_len = staged

    def store(self, layer, k, v):
        write_kv(self.k_pool[layer], self.v_pool[layer], self.slots, k, v)

    def attend_one_token(self, layer, q):
        pools = self.k_pool[layer], self.v_pool[layer]
        table, kv_len = self.one_token_table, self.one_token_len
        if self.lone:  # one row: its keys' slots, in place
            keys, values = (pool.flatten(0, 1)[None, self.lone] for pool in pools)  # (1, L, H, D)
            return attend(q[:, None], keys, values)[:, 0]
        if not self.compiled:  # copy whole blocks out, then SDPA
            keys, values = (gather_kv(pool, table) for pool in pools)  # (B, L, H, D)
            if layer == 0:  # NOTE: the rows' mask once a step, additive: SDPA converts a boolean one at every call
                self.mask = visible_keys(keys, kv_len[:, None] - 1).to(q.dtype).log()  # 0 (log 1) or -inf
            return attend(q[:, None], keys, values, self.mask)[:, 0]
        for t in (q, table, kv_len, *pools):  # one graph for every batch, width and pool size
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        return compiled_gather_attend()(q, *pools, table, kv_len)

    def chunk_kv(self, layer, chunk):
        num_blocks = blocks_for(int(self.kv_lens[chunk.entry]), self.k_pool.shape[2])
        table = self.table[chunk.entry, None, :num_blocks]
        return gather_kv(self.k_pool[layer], table), gather_kv(self.v_pool[layer], table)
