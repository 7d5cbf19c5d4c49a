"""The events an engine tells its observers, as vLLM's engine calls its stat loggers: the engine keeps no
measurements, and what measures it (metrics.Meter, plots.PoolMap) listens."""


class Observer:
    """What an engine tells its observers (metrics.Meter, plots.PoolMap): add() tells added; a step's schedule() admits,
    preempts and copies on write; then come planned, sampled and stepped. A subclass overrides what it needs;
    the engine itself keeps no measurements."""

    def added(self, request):  # a request joined the waiting queue
        pass

    def planned(self, plan):  # the step's plan, before the forward
        pass

    def sampled(self, plan):  # the step's tokens are on the host
        pass

    def stepped(self):  # the step's bookkeeping is done
        pass

    def admitted(self, group):  # sequences admitted to run, each with num_computed cached tokens
        pass

    def preempted(self, sequence):  # a sequence let go of its blocks: its K/V in the swap space, or to be recomputed
        pass

    def swapping(self):  # a copy between the pool and the swap space starts
        pass

    def swapped_in(self, sequence, num_blocks):  # its K/V are back in the pool: num_blocks copied, the rest cached
        pass

    def copied(self, block):  # a block copied on write, now held by the sequence that writes it
        pass

    def verified(self, sequence, proposed, accepted):  # speculative decoding kept `accepted` of `proposed` tokens
        pass
