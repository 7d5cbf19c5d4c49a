"""Serve many prompts with a nanoGPT checkpoint: the contiguous baseline, or the paged engine.

    python generate.py                                   # trains out/ckpt.pt first if it is missing
    python generate.py --paged --prompt "ROMEO:" --num-samples 4
    python generate.py --compare --num-requests 64 --shared-prefix 100 --prompt-len 101:160 --new-tokens 16:64 --plot c.png
"""
import argparse
import json
import os
import random
import sys
import time

import torch

from model import load_checkpoint
from scheduler import ContiguousEngine, Request, Scheduler
from train_tiny import get_tokenizer, shakespeare, train

def metrics(engine, wall_s):
    reqs, stats = engine.finished, engine.stats
    out = sum(len(r.generated) for r in reqs)
    ttft = sorted((r.first_token_at - r.arrival) * 1000 for r in reqs)
    per_token = [(r.done_at - r.first_token_at) * 1000 / (len(r.generated) - 1) for r in reqs if len(r.generated) > 1]
    peak = max(stats, key=lambda s: s["allocated"])
    busiest = max(stats, key=lambda s: s["running"])  # what reserving the whole context per request would take
    m = dict(output_tokens=out, wall_s=wall_s, output_tok_s=out / wall_s, ttft_ms_mean=sum(ttft) / len(ttft),
             ttft_ms_p90=ttft[int(0.9 * (len(ttft) - 1))], ms_per_token=sum(per_token) / max(1, len(per_token)),
             steps=len(stats), prefill_tokens=engine.prefill_tokens, preemptions=engine.num_preemptions,
             kv_slots_allocated_peak=peak["allocated"], kv_slots_used_peak=peak["used"],
             kv_waste_pct=100 * (1 - peak["used"] / max(1, peak["allocated"])),
             kv_slots_static=busiest["running"] * engine.context,
             static_used_pct=100 * busiest["used"] / max(1, busiest["running"] * engine.context), prefix_hit_rate=0.0)
    if isinstance(engine, Scheduler):
        m.update(num_blocks=engine.allocator.num_blocks, block_size=engine.block_size,
                 peak_blocks=peak["allocated"] // engine.block_size,
                 prefix_hit_rate=engine.cached_prompt_tokens / max(1, engine.prompt_tokens))
    return m

def table(runs):
    """One column per run, then each later run's ratio to the first."""
    keys = ["same_output_pct", "output_tokens", "wall_s", "output_tok_s", "ttft_ms_mean", "ttft_ms_p90", "ms_per_token", "steps",
            "prefill_tokens", "prefix_hit_rate", "preemptions", "kv_slots_allocated_peak", "kv_slots_used_peak",
            "kv_waste_pct", "kv_slots_static", "static_used_pct", "peak_blocks", "num_blocks", "block_size"]
    names = list(runs)
    rows = [f"{'metric':<24}" + "".join(f"{n:>14}" for n in names) + "".join(f"{n + '/' + names[0]:>26}" for n in names[1:])]
    for k in keys:
        vals = [runs[n].get(k) for n in names]
        cells = "".join(f"{'-' if v is None else f'{v:.4g}':>14}" for v in vals)
        ratios = "".join(f"{f'{v / vals[0]:.2f}x' if v is not None and vals[0] else '-':>26}" for v in vals[1:])
        rows.append(f"{k:<24}{cells}{ratios}")
    return "\n".join(rows)

def workload(enc, args):
    """Prompts cut from the held-out plays, seeded; each request generates exactly its drawn count."""
    rng = random.Random(args.seed)
    val = enc.encode_ordinary(shakespeare()[1])
    lo, hi = args.prompt_len
    shared = val[:args.shared_prefix]
    prompts, news = [], []
    for _ in range(args.num_requests):
        start = rng.randrange(args.shared_prefix, len(val) - hi)
        prompts.append(shared + val[start:start + max(1, rng.randint(lo, hi) - len(shared))])
        news.append(rng.randint(*args.new_tokens))
    return prompts, news

def serve(model, prompts, news, args, kind):
    """Run one engine over the requests -> (requests in input order, metrics, per-step stats)."""
    requests = [Request(p, n, args.temperature, args.top_k, seed=args.seed + i) for i, (p, n) in enumerate(zip(prompts, news))]
    if kind == "contiguous":
        engine = ContiguousEngine(model, args.max_batch)
    else:
        bs = args.block_size
        num_blocks = args.num_blocks or sum(-(-(len(p) + n - 1) // bs) for p, n in zip(prompts, news))
        engine = Scheduler(model, num_blocks, bs, args.token_budget, args.max_batch, prefix_cache=kind == "paged_prefix")
    start = time.perf_counter()
    engine.run(requests)  # every step ends in a host transfer of its tokens, so no GPU work is left pending
    return requests, metrics(engine, time.perf_counter() - start), engine.stats

def plot(all_stats, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, stats in all_stats.items():
        axes[0].plot([s["allocated"] for s in stats], label=name)
        axes[1].plot([s["running"] for s in stats], label=name)
        axes[2].scatter([s["context"] for s in stats], [1000 * s["seconds"] for s in stats], s=6, label=name)
    for ax, (title, x, y) in zip(axes, [("KV slots allocated", "step", "slots"), ("running requests", "step", "requests"),
                                        ("step time vs context in batch", "keys attended in the step", "ms")]):
        ax.set(title=title, xlabel=x, ylabel=y)
        ax.legend()
    axes[2].set_yscale("log")  # a whole-batch prefill step would flatten the rest
    fig.tight_layout()
    fig.savefig(path, dpi=110)

def at_least(least, kind=int):
    def parse(text):
        value = kind(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value
    return parse

def span(text):
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(f"error: {message}")  # one line, no usage dump
    p.add_argument("--ckpt", default="out/ckpt.pt")
    p.add_argument("--prompt", action="append", help="repeatable")
    p.add_argument("--prompts", help="file with one prompt per line")
    p.add_argument("--num-samples", type=at_least(1), default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=at_least(1), default=100)
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=at_least(1), default=200)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-batch", type=at_least(1), default=64, help="requests running at once")
    p.add_argument("--json", help="write requests and metrics to this file")
    p.add_argument("--paged", action="store_true", help="serve with the paged engine")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--num-blocks", type=at_least(1), help="default: enough for every request at once")
    p.add_argument("--token-budget", type=at_least(1), default=256, help="tokens per paged step")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--compare", action="store_true", help="contiguous, paged, paged + prefix cache, one workload")
    p.add_argument("--num-requests", type=at_least(1), help="serve a seeded workload cut from held-out text")
    p.add_argument("--prompt-len", type=span, default=(16, 128), help="workload prompt tokens, MIN:MAX")
    p.add_argument("--new-tokens", type=span, default=(16, 128), help="workload new tokens, MIN:MAX")
    p.add_argument("--shared-prefix", type=at_least(0), default=0, help="tokens every workload prompt starts with")
    p.add_argument("--plot", help="draw the runs to this PNG")
    return p.parse_args(argv)

def read_prompts(args, enc):
    """The prompts as (texts, token lists, new-token counts), or exit with a one-line error."""
    if args.num_requests or args.compare:
        args.num_requests = args.num_requests or 64
        prompts, news = workload(enc, args)
        return [enc.decode(p) for p in prompts], prompts, news
    texts = list(args.prompt or [])
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                texts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        except OSError as e:
            sys.exit(f"error: cannot read --prompts file {args.prompts}: {e.strerror}")
        if not texts:
            sys.exit(f"error: --prompts file {args.prompts} holds no prompt")
    texts = [t for t in texts or ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "KING LEAR:\n"] for _ in range(args.num_samples)]
    prompts = [enc.encode(t, allowed_special={"<|endoftext|>"}) for t in texts]  # Engine.add checks each
    return texts, prompts, [args.max_new_tokens] * len(prompts)

def main(argv=None):
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device} asked for, but this torch sees no CUDA GPU")
    if args.ckpt == "out/ckpt.pt" and not os.path.exists(args.ckpt):
        print("no checkpoint at out/ckpt.pt: training the tiny model first (about 5 minutes on 2 CPU cores)")
        train(out_dir="out", device=args.device)
    try:
        model = load_checkpoint(args.ckpt, args.device).to(getattr(torch, args.dtype))
    except ValueError as e:
        sys.exit(f"error: {e}")
    enc = get_tokenizer(model.config.vocab_size)
    texts, prompts, news = read_prompts(args, enc)
    kinds = ["contiguous", "paged", "paged_prefix"] if args.compare else \
        ["paged" if args.no_prefix_cache else "paged_prefix"] if args.paged else ["contiguous"]
    runs, all_stats = {}, {}
    try:
        for kind in kinds:
            requests, runs[kind], all_stats[kind] = serve(model, prompts, news, args, kind)
            if kind == kinds[0]:
                first = requests
            else:  # token for token against the first run, on the same workload
                same = sum(r.generated == f.generated for r, f in zip(requests, first))
                runs[kind]["same_output_pct"] = 100 * same / len(requests)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not args.num_requests:
        for i, r in enumerate(requests):
            print(f"--- request {i}, {len(r.generated)} new tokens\n{texts[i]}{enc.decode(r.generated)}")
    print(f"--- {len(prompts)} requests on {args.device}, {args.dtype}\n{table(runs)}")
    if args.plot:
        plot(all_stats, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        out = {"runs": runs} if args.compare else {"metrics": runs[kinds[0]], "requests": [
            {"prompt": t, "prompt_tokens": r.tokens[:r.num_prompt], "output_tokens": r.generated,
             "text": enc.decode(r.generated)} for t, r in zip(texts, requests)]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

if __name__ == "__main__":
    main()
