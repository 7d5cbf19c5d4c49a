"""A candidate, not in the engine: vLLM V1's async scheduling on the paged engine. A step's sampled tokens stay
on the device while the next step is planned, built and launched; only then does the host wait for them. On a
GPU the host's work for step n + 1 (plan, batch, staging, launch) and its bookkeeping of step n then run while
the device runs, so that a step costs the larger of the two instead of their sum. On a CPU nothing overlaps
(the forward runs on the calling thread), but the tokens are the same, which tests/test_bench.py checks.

How a token that is not on the host yet is used:
- each sampler's sequence gets a placeholder token, -1 - j for sampler j, at once; the next step's batch
  stages it as it is, and one device op swaps every negative id for the pending step's token j;
- a sequence whose placeholder is its max_new_tokens-th token stops at once, as no later step needs it;
- a sequence that sampled eos learns it one step late: it ran one more step, whose token is dropped.
A step falls back to the engine's own order (tokens on the host before the bookkeeping) when a beam group is
live, as beams need their log-probabilities on the host, and waits for the pending tokens first when the pool
could run short, as preempting a sequence whose token is in flight is not handled.

    python bench/async_step.py [--num-requests 32] [--device cpu|cuda] [--compile off]

run on its own, serves the same requests (the shipped model, random prompts, greedy and sampled) on the engine
and on the candidate, and prints each one's tok/s and whether their tokens are the same; bench/gpu.py runs it
end to end on a GPU. It subclasses ext.ServingEngine, every extension in, as the tests' engine does.
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import ServingEngine
from harness.checkpoints import SHIPPED, load_checkpoint
from paged import blocks_for
from sequence import Request, RequestStatus, SamplingParams, SequenceStatus


class AsyncPagedEngine(ServingEngine):
    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        # the last step's tokens not yet on the host: (samplers, device tokens, host copy, its event, placeholder
        # index of each sampler in its sequence's tokens)
        self.pending = None

    def beams_live(self):
        return any(s.request.params.num_beams > 1 for s in self.running + list(self.waiting))

    @torch.no_grad()
    def step(self):
        """Engine.step's plan, batch, forward and draw, then the wait for the step before's tokens, then this
        step's bookkeeping: on a GPU the device runs this step meanwhile."""
        # a decode step takes at most one new block for each running sequence (prefill's are taken at admission)
        if self.pending and (self.beams_live() or self.allocator.num_free() < len(self.running)):
            self.resolve()
            if not self.running and not self.waiting:  # the last sequences sampled eos
                return
        if self.beams_live():
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", default="off", help="both engines' compile mode (graph: CUDA graphs)")
    args = p.parse_args()
    model = load_checkpoint(SHIPPED, args.device)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(args.num_requests)]
    news = [rng.randint(16, 64) for _ in prompts]
    num_blocks = sum(blocks_for(len(p) + n, 16) for p, n in zip(prompts, news))
    print(f"$ python bench/async_step.py --num-requests {args.num_requests} --device {args.device} "
          f"--compile {args.compile}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}; the shipped model, prompts of 16-128 random ids, 16-64 new, "
          "every other request sampled (0.8, top-k 200)")  # fmt: skip
    outputs = {}
    for cls in (ServingEngine, AsyncPagedEngine):
        requests = [
            Request(p, n, SamplingParams(temperature=0.8 * (i % 2), top_k=200, seed=i))
            for i, (p, n) in enumerate(zip(prompts, news))
        ]
        engine = cls(model, num_blocks=num_blocks, compile=args.compile)
        start = time.perf_counter()
        engine.run(requests)
        seconds = time.perf_counter() - start
        outputs[cls] = [r.generated for r in requests]
        print(f"{cls.__name__:<16} {sum(news) / seconds:>9,.0f} tok/s")
    same = sum(a == b for a, b in zip(outputs[ServingEngine], outputs[AsyncPagedEngine]))
    print(f"the same tokens in {same} of {len(prompts)} requests")


if __name__ == "__main__":
    main()
