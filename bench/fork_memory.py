"""The vLLM paper's sharing experiment (its Sec. 6.3, Fig. 15), on our engine: KV blocks in use with forks
that share blocks, against each sequence holding private copies, for n samples and k beams per request.

    python bench/fork_memory.py [--ckpt out/ckpt.pt] [--num-requests 32] [--plot docs/runs/fork_memory.png]
                                [--prompt-len 16:128] [--new-tokens 16:128]

The workload is generate.py's default one, not one picked for sharing: prompts of 16-128 tokens cut from
the held-out plays and 16-128 new tokens each (seed 1), every request arriving at once, a pool that holds
everything (no preemption) and no prefix cache, so the only sharing is the forks'. Each step records:
  shared:  blocks held (what the allocator has handed out)
  private: the blocks the same sequences would hold if each had its own copy of every block (the sum of
           their block-table lengths), i.e. forks that copy instead of share
Savings = 1 - shared / private, over the whole run (blocks x steps, the paper's average) and at the peak.
Output tok/s counts every sample, and each request's best beam; for n samples it is shown against n
separate requests per prompt (each with its own prefill and blocks). The engine is the one `generate.py
--paged --num-samples n` builds: PagedEngine with the forks extension, ext/forks.py.
"""

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import engine_class
from harness.checkpoints import get_tokenizer, load_checkpoint
from harness.flags import check_image_name, fail, number_type, prepare_output, span
from harness.metrics import Meter
from harness.serving import workload
from harness.tuning import prepare
from sequence import Request, SamplingParams


def run(model, requests, vocab_size, width):
    """Step the engine by hand -> (seconds, per-step blocks held, per-step blocks if nothing were shared)."""
    num_blocks = sum(-(-(len(r.prompt) + r.max_new_tokens - 1) // 16) for r in requests) * width
    engine = engine_class(forks=True)(
        model,
        num_blocks=num_blocks,
        max_batch=len(requests) * width,
        token_budget=4096,
        prefix_cache=False,
        vocab_size=vocab_size,
        compile="off",
    )
    meter = Meter(engine)
    for r in requests:
        try:
            engine.add(r)
        except ValueError as e:  # a request the model cannot hold: one line, as generate.py, before any step
            fail(e)
    shared, private, start = [], [], time.perf_counter()
    while engine.running or engine.waiting:
        engine.step()
        shared.append(engine.allocator.num_blocks - engine.allocator.num_free())
        private.append(sum(len(s.block_table) for s in engine.running))
    seconds = time.perf_counter() - start
    assert meter.num_preemptions == 0 and engine.allocator.num_free() == engine.allocator.num_blocks
    return seconds, shared, private


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: fail(message)  # one line, no usage dump, as generate.py
    p.add_argument(
        "--ckpt",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "tiny-shakespeare.pt"),
    )
    p.add_argument("--num-requests", type=number_type(1), default=32)
    p.add_argument("--plot", help="draw blocks in use per step, shared against private, to this image")
    p.add_argument("--prompt-len", type=span, default=(16, 128), help="MIN:MAX prompt tokens")
    p.add_argument("--new-tokens", type=span, default=(16, 128), help="MIN:MAX new tokens")
    return p


def parse_args(argv=None):
    """The flags, checked before the run: the --plot image's name, and its folder, made now if missing (or a
    one-line error), not found missing at savefig after the whole run."""
    args = parser().parse_args(argv)
    if args.plot:
        check_image_name("--plot", args.plot)
        prepare_output("--plot", args.plot)
    return args


def main(argv=None):
    args = parse_args(argv)
    (a, b), (c, d) = args.prompt_len, args.new_tokens
    shape = f"{args.num_requests} requests, prompts {a}-{b} tokens, {c}-{d} new"
    try:
        model = load_checkpoint(args.ckpt)
    except ValueError as e:
        fail(e)
    prepare(model)
    enc = get_tokenizer(model.config.vocab_size)
    spec = SimpleNamespace(
        seed=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens, num_requests=args.num_requests, shared_prefix=0
    )
    try:
        prompts, news = workload(enc, spec)
    except ValueError as e:  # a workload the held-out text cannot hold
        fail(e)
    print(
        f"{shape}, block size 16, {args.ckpt}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'run':<10} {'blocks shared':>14} {'private':>9} {'saved':>7} {'peak shared':>12} {'peak private':>13} "
        f"{'saved':>7} {'out tok/s':>10} {'separate':>9}"
    )
    traces = {}
    model(torch.tensor([[1]]))  # one-time setup out of the first run's time
    for kind, width in [("samples", 2), ("samples", 4), ("samples", 6), ("beams", 2), ("beams", 4), ("beams", 6)]:
        if kind == "samples":
            requests = [
                Request(pr, m, SamplingParams(temperature=0.8, top_k=200, seed=100 * i, n=width))
                for i, (pr, m) in enumerate(zip(prompts, news))
            ]
        else:
            requests = [Request(pr, m, SamplingParams(num_beams=width)) for pr, m in zip(prompts, news)]
        seconds, shared, private = run(model, requests, enc.n_vocab, width)
        returned = width if kind == "samples" else 1
        tok_s = sum(news) * returned / seconds
        separate = ""
        if kind == "samples":  # the same samples as separate requests: n prefills, nothing shared
            alone = [
                Request(pr, m, SamplingParams(temperature=0.8, top_k=200, seed=100 * i + j))
                for i, (pr, m) in enumerate(zip(prompts, news))
                for j in range(width)
            ]
            alone_s, _, _ = run(model, alone, enc.n_vocab, 1)
            assert [s.generated for r in requests for s in r.sequences] == [r.generated for r in alone]
            separate = f"{sum(news) * width / alone_s:,.0f}"
        name = f"{kind} {width}"
        traces[name] = (shared, private)
        saved, peak_saved = 1 - sum(shared) / sum(private), 1 - max(shared) / max(private)
        print(
            f"{name:<10} {sum(shared) / len(shared):>14,.0f} {sum(private) / len(private):>9,.0f} {saved:>7.1%} "
            f"{max(shared):>12,} {max(private):>13,} {peak_saved:>7.1%} {tok_s:>10,.0f} {separate:>9}",
            flush=True,
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
        for ax, kind in zip(axes, ["samples", "beams"]):
            for name, (shared, private) in traces.items():
                if name.startswith(kind):
                    (line,) = ax.plot(shared, label=f"{name}, shared")
                    ax.plot(private, "--", color=line.get_color(), label=f"{name}, private copies")
            ax.set(title=f"KV blocks in use: {kind}", xlabel="step", ylabel="blocks")
            ax.legend(fontsize=8)
        fig.suptitle(f"fork with copy-on-write: {shape}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
