"""Swap preemption, the vLLM paper's Sec. 4.5: a preempted sequence's K/V are copied to a swap space in host
memory, and back into new blocks when it is readmitted, instead of being recomputed. A swap space too full to
take a victim leaves it to be recomputed, as the core does. Plugs into the paged engine at save_kv (called by
preempt) and admit."""

from paged import allocate_pool, blocks_for


class Swap:
    """A PagedEngine mixin: swap_blocks blocks of the pool's shape in host memory (pinned on a GPU, for fast
    copies). Blocks a victim shares with running sequences are copied too, and stay where they are, with them."""

    def __init__(self, model, *, swap_blocks=0, **kw):
        super().__init__(model, **kw)
        if swap_blocks < 0:
            raise ValueError(f"swap_blocks is {swap_blocks}; it must be >= 0")
        self.swap_blocks = swap_blocks
        # - 1: allocate_pool adds a padding block, which a swap space does not need
        self.swap_space = allocate_pool(model.config, swap_blocks - 1, self.block_size, "cpu", self.kv_pool.dtype)
        if self.kv_pool.is_cuda:  # pinned, for fast copies
            self.swap_space = self.swap_space.pin_memory()
        self.free_swap = list(range(swap_blocks))  # a stack, as the allocator's clean blocks
        self.swapped = {}  # a swapped-out sequence -> the swap space's block that holds each of its logical blocks

    def save_kv(self, s):
        """s's K/V copied to the swap space in one indexed copy, if it can take them all -> the tokens kept."""
        num_blocks = blocks_for(s.num_computed, self.block_size)
        if num_blocks > len(self.free_swap):
            return super().save_kv(s)
        self.notify("swapping")
        swapped = [self.free_swap.pop() for _ in range(num_blocks)]
        self.swap_space[:, :, swapped] = self.kv_pool[:, :, s.block_table[:num_blocks]].cpu()
        self.swapped[s] = swapped
        return s.num_computed

    def admit(self, s, cached):
        """A swapped-out s gets its K/V back into new blocks, in one indexed copy, after its prefix-cache hits
        (blocks it shared before it was swapped out, if they are still cached)."""
        swapped = self.swapped.pop(s, [])
        if not swapped:
            return super().admit(s, cached)
        rest = swapped[len(cached) :]
        blocks = self.allocator.allocate(len(rest))
        self.notify("swapping")
        self.kv_pool[:, :, blocks] = self.swap_space[:, :, rest].to(self.device)
        self.free_swap += swapped
        self.notify("swapped_in", s, len(blocks))
        num_computed = max(s.num_computed, len(cached) * self.block_size)  # its last swapped block may be partial
        super().admit(s, cached + blocks)
        s.num_computed = num_computed
