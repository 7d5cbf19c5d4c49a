"""Decode attention through flex_attention: the CUDA extension's switch decode_attention (ext/cuda.py), on by
default in the GPU path's padded steps of 64 rows or more, where an H200 measured it faster. The block table
becomes flex's block mask over the pool flattened to slots, so that flex's decoding kernel streams each row's own
blocks, reads the pool in place, and skips a padded table's empty entries, which gather_attend computes and masks
away (a decode graph's rows are all as wide as the longest context).

Every block goes through an exact mask_mod; none is marked whole. Marking a row's full blocks whole and sending
only its last block through mask_mod would read the wrong keys on a GPU: torch 2.13's decoding kernel reads the
whole blocks' index table with the partial ones' strides and width, and with whole blocks it splits the pool's
length among its programs instead of each row's blocks."""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def flex_block_mask(block_table, kv_len, num_pool_blocks, block_size):
    """flex_attention's block mask for decode rows that read the pool in place, flattened to slots
    (num_pool_blocks * block_size keys) -> BlockMask. Row b's key blocks are its own blocks, all through mask_mod,
    which is exact on its own (it finds each slot's place in the row's sequence), as eager flex_attention applies
    it to every key. block_table: (B, W), its entries past a row's blocks stale or padding; kv_len: (B,)."""
    B, W = block_table.shape
    device = block_table.device
    logical = torch.arange(W, device=device)
    num_blocks = -(-kv_len // block_size)  # (B,)
    held = logical < num_blocks[:, None]  # (B, W)
    padding = num_pool_blocks - 1
    table = torch.where(held, block_table.long(), padding)  # stale entries: the padding block
    # (B, pool blocks + 1): each block's index in row b, or -1; entries past a row's blocks land in the extra
    # column, so that none overwrites a block the row holds (a padding row holds the padding block)
    place = torch.full((B, num_pool_blocks + 1), -1, device=device)
    columns = torch.where(held, table, num_pool_blocks)
    place.scatter_(1, columns, logical.expand(B, W).contiguous())

    def visible(b, h, q_idx, kv_idx):
        j = place[b, kv_idx // block_size]  # the key's block's place in row b's sequence, or -1
        position = j * block_size + kv_idx % block_size
        return (j >= 0) & (position < kv_len[b])

    return BlockMask.from_kv_blocks(
        num_blocks.int().view(B, 1, 1),
        table.int().view(B, 1, 1, W),
        BLOCK_SIZE=(128, block_size),
        mask_mod=visible,
        seq_lengths=(1, num_pool_blocks * block_size),
        compute_q_blocks=False,
    )


def flex_paged_attend(q, k_pool, v_pool, block_mask):
    """One layer: q (B, H, D), pools (num_pool_blocks, block_size, H, D) -> (B, H, D)."""
    k = k_pool.flatten(0, 1).transpose(0, 1)[None]  # (1, H, slots, D): a view, no copy
    v = v_pool.flatten(0, 1).transpose(0, 1)[None]
    out = flex_attention(q[:, :, None], k, v, block_mask=block_mask)  # (B, H, 1, D)
    return out[:, :, 0]


@functools.cache
def compiled_flex():
    """Static shapes: flex_attention's decoding kernel needs the batch and heads fixed (else its general one),
    so each batch bucket compiles its own."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    return torch.compile(flex_paged_attend, dynamic=False)


def flex_attend(device):
    """The attention a step on `device` runs: compiled on CUDA; eager on a CPU, where inductor's flex template
    refuses a block mask narrower than the keys (eager applies mask_mod to every key: the same outputs)."""
    return compiled_flex() if device.type == "cuda" else flex_paged_attend
