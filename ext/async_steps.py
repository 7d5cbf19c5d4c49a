"""Async scheduling, as vLLM V1 has it: the CUDA extension's switch async_steps (ext/cuda.py), on by default in
the GPU path (CUDA with compile="graph"), where a GPU measured it. A step's sampled tokens stay on the device
while the next step is planned, built and launched; only then does the host wait for them. On a GPU the host's
work for step n + 1 (plan, batch, staging, launch) and its bookkeeping of step n then run while the device runs,
so that a step costs the larger of the two instead of their sum. On a CPU nothing overlaps (the forward runs on
the calling thread), but the tokens are the engine's own, which tests/test_decode_graphs.py checks.

How a token that is not on the host yet is used:
- each sampler's sequence gets a placeholder token, -1 - j for sampler j, at once; the next step's batch
  stages it as it is, and one device op swaps every negative id for the pending step's token j;
- a sequence whose placeholder is its max_new_tokens-th token stops at once, as no later step needs it;
- a sequence that sampled eos learns it one step late: it ran one more step, whose token is dropped;
- a request finishes when its last tokens reach the host, a step after their launch.
A step runs in the engine's own order (tokens on the host before the bookkeeping) when a beam group is live, as
beams need their log-probabilities on the host, or a request asks for logprobs, or speculation is on, as
proposals read the tokens; and it waits for the pending tokens first when the pool could run short, as
preempting a sequence whose token is in flight is not handled."""

import torch

from sequence import RequestStatus, SequenceStatus


class AsyncSteps:
    """A PagedEngine mixin, the CUDA extension's base: with async_steps, step draws on the device and leaves the
    tokens there until the next step has launched. Without it, step is the engine's own. "auto": on in the GPU
    path, where an H200 measured it 1.15-1.32x end to end with the same tokens (docs/gpu.md); off elsewhere."""

    def __init__(self, model, *, async_steps="auto", **kw):
        super().__init__(model, **kw)
        if async_steps == "auto":
            async_steps = self.device.type == "cuda" and self.compile == "graph"
        self.async_steps = async_steps
        # the last step's tokens not yet on the host: (samplers, device tokens, host copy, its event, placeholder
        # index of each sampler in its sequence's tokens)
        self.pending = None

    def in_order(self):
        """Whether this step runs in the engine's order: a live request's beams need their log-probabilities on the
        host, or its logprobs theirs (ext/logprobs.py), or speculation is on (ext/speculative.py)."""
        for s in self.running + list(self.waiting):
            p = s.request.params
            if p.num_beams > 1 or getattr(p, "logprobs", None) is not None:
                return True
            if getattr(p, "prompt_logprobs", None) is not None:
                return True
        return getattr(self, "num_speculative_tokens", 0) != 0

    @torch.no_grad()
    def step(self):
        """Engine.step's plan, batch, forward and draw, then the wait for the step before's tokens, then this
        step's bookkeeping: on a GPU the device runs this step meanwhile."""
        if not self.async_steps:
            return super().step()
        in_order = self.in_order()
        # a decode step takes at most one new block for each running sequence (prefill's are taken at admission)
        if self.pending and (in_order or self.allocator.num_free() < len(self.running)):
            self.resolve()
            if not self.running and not self.waiting:  # the last sequences sampled eos
                return
        if in_order:
            return super().step()
        plan = self.schedule()
        if not plan:
            raise RuntimeError(f"no progress: {len(self.waiting)} waiting, {len(self.running)} running")
        self.notify("planned", plan)
        samplers = self.samplers(plan)
        launched = self.launch(plan, samplers)
        positions = []
        for j, (s, _, _) in enumerate(samplers):  # placeholders, until the tokens reach the host
            s.status = SequenceStatus.DECODING
            s.tokens.append(-1 - j)
            positions.append(len(s.tokens) - 1)
        self.resolve()  # the step before's tokens
        self.pending = (samplers, *launched, positions) if samplers else None
        # the forks made this step take their parent's K/V here (ext/forks.py)
        self.mark_computed([e for e in plan if e.sequence.status is not SequenceStatus.DONE])
        for s, _, _ in samplers:
            if s.status is not SequenceStatus.DONE and len(s.generated) == s.request.max_new_tokens:
                self.stop(s, SequenceStatus.DONE)
        if not self.running and not self.waiting:  # nothing will step again: the tokens are needed now
            self.resolve()
        self.notify("sampled", plan)
        self.notify("stepped")

    def launch(self, plan, samplers):
        """Build the step's batch, with the pending step's tokens for its placeholders, run the forward and the
        draw, and start the tokens' copy to the host -> (device tokens, host copy, the copy's event or None)."""
        batch = self.make_batch(plan, samplers)
        if self.pending:  # placeholders -> the pending step's tokens, on the device
            last = self.pending[1]
            batch.idx.copy_(torch.where(batch.idx < 0, last[(-1 - batch.idx).clamp(min=0)], batch.idx))
        logits = self.forward(batch)  # (S, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.vocab_size :] = float("-inf")
        tokens = self.sample(logits, batch, samplers)
        host = torch.empty(len(samplers), dtype=torch.long, pin_memory=tokens.is_cuda)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event() if tokens.is_cuda else None
        if event:
            event.record()
        return tokens, host, event

    def resolve(self):
        """The pending step's tokens take their placeholders' places; a sequence that sampled eos stops (its
        next step's token, if it ran, dropped), and a request whose sequences are all done finishes."""
        if self.pending is None:
            return
        samplers, _, host, event, positions = self.pending
        self.pending = None
        if event:
            event.synchronize()
        for (s, _, _), position, token in zip(samplers, positions, host.tolist()):
            if position >= len(s.tokens):  # it sampled eos the step before: this row's token is dropped
                continue
            s.tokens[position] = token
            if token == s.request.params.eos and s.status is not SequenceStatus.DONE:
                del s.tokens[position + 1 :]  # the placeholder of a step that ran after it
                self.stop(s, SequenceStatus.DONE)
        for r in dict.fromkeys(s.request for s, _, _ in samplers):  # NOTE: a sequence stops at max_new_tokens only
            # after this, in the step that set its last placeholder, so every done sequence's tokens are here
            if r.status is not RequestStatus.DONE and all(x.status is SequenceStatus.DONE for x in r.sequences):
                self.finish(r)
