"""--paged against Hugging Face transformers' GPT2LMHeadModel.generate on the same weights and prompts.

    pip install transformers          # not in requirements.txt (requirements-test.txt has it)
    python bench/hf_compare.py [--repeats 3] [--threads N] [--rows equal,mixed,samples4,beams4] [--num-prompts 64]

Random GPT-2-shaped weights (4 layers, 128 wide, 4 heads, GPT-2's vocabulary padded to 50,304 as nanoGPT
does, 512 context) are saved as a nanoGPT checkpoint, loaded by our loader and copied into transformers'
GPT-2. 64 prompts of 16-200 tokens are cut from the held-out plays (seed 1), decoded greedily, and:
  equal:    64 new tokens each (HF's best case: one left-padded batch, nothing wasted)
  mixed:    8-128 new tokens each (HF runs the whole batch to the longest; only useful tokens count)
  samples4: 4 samples of each prompt, 64 new tokens (temperature 0.8, top-k 200): HF's
            num_return_sequences=4 (its batch holds 4 copies of each prompt), ours forks after one prefill
  beams4:   beam search, 4 beams, 64 new tokens: HF's num_beams=4 against ours on shared blocks; the
            output counted is each request's best beam
HF and ours alternate in one process, repeated; each row is a median with min-max, the ratio per repeat.
Both sides never emit ids 50,257-50,303 (not tokens); outputs are checked token for token (samples are
drawn from different random streams, so they are not compared). Ours runs every sequence at once, as HF
does (max_batch = prompts x samples or beams), on the engine `generate.py --paged` builds: PagedEngine, with
the forks extension (ext/forks.py) for samples and beams.
"""

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import engine_class
from harness.checkpoints import get_tokenizer, load_checkpoint, shakespeare, to_transformers
from harness.flags import prepare_output
from harness.tuning import prepare
from model import GPT, GPTConfig
from sequence import Request, SamplingParams


def make_models(path):
    torch.manual_seed(0)
    config = GPTConfig(block_size=512, vocab_size=50304, n_layer=4, n_head=4, n_embd=128)
    torch.save({"model": GPT(config).state_dict(), "model_args": vars(config)}, path)
    ours = load_checkpoint(path)
    return ours, to_transformers(ours)  # like ours, HF generates exactly the asked-for count


def workload(seed, n, news=(64, 64)):
    rng = random.Random(seed)
    enc = get_tokenizer(50304)
    val = enc.encode_ordinary(shakespeare()[1])
    prompts = []
    for _ in range(n):
        start, length = rng.randrange(len(val) - 200), rng.randint(16, 200)
        prompts.append(val[start : start + length])
    return prompts, [rng.randint(*news) for _ in range(n)]


SETTINGS = {
    "equal": dict(),
    "mixed": dict(),
    "samples4": dict(n=4, temperature=0.8, top_k=200),
    "beams4": dict(num_beams=4),
}


@torch.no_grad()
def run_hf(hf, prompts, news, n=1, num_beams=1, temperature=0.0, top_k=None):
    """One left-padded batch run to the longest request -> (seconds, outputs cut to each one's count)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature else dict(do_sample=False)
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max(news),
        min_new_tokens=max(news),
        pad_token_id=0,
        suppress_tokens=list(range(50257, 50304)),
        num_return_sequences=n,
        num_beams=num_beams,
        **sampling,
    )
    seconds = time.perf_counter() - start
    return seconds, [out[i * n, width : width + m].tolist() for i, m in enumerate(news)]


@torch.no_grad()
def run_ours(model, prompts, news, n=1, num_beams=1, temperature=0.0, top_k=None):
    """The engine as `generate.py --paged` builds it (pool sized to fit every request), every sequence at once."""
    requests = [
        Request(p, m, SamplingParams(temperature=temperature, top_k=top_k, seed=i, n=n, num_beams=num_beams))
        for i, (p, m) in enumerate(zip(prompts, news))
    ]
    num_blocks = sum(-(-(len(p) + m - 1) // 16) for p, m in zip(prompts, news)) * max(n, num_beams)
    prepare(model)  # on a CPU, the linears in oneDNN's layout, as generate.py loads a model
    width = max(n, num_beams)
    engine = engine_class(forks=width > 1)(
        model, num_blocks=num_blocks, max_batch=len(prompts) * width, vocab_size=50257
    )
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start, [r.generated for r in requests]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ckpt", default="out/bench_gpt2_random.pt")
    p.add_argument("--rows", default="equal,mixed,samples4,beams4", help="comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--num-prompts", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prepare_output("--ckpt", args.ckpt)  # the folder the random weights are saved to, or one line now
    ours, hf = make_models(args.ckpt)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"{'workload':<8} {'HF tok/s':>22} {'--paged tok/s':>22} {'paged / HF':>22}  same output")
    for name in args.rows.split(","):
        settings = SETTINGS[name]
        prompts, counts = workload(1, args.num_prompts, news=(8, 128) if name == "mixed" else (64, 64))
        useful = sum(counts) * settings.get("n", 1)
        # warm-up on 16 prompts: enough decode rows that ours compiles its decode attention before anything is timed
        run_hf(hf, prompts[:16], counts[:16], **settings), run_ours(ours, prompts[:16], counts[:16], **settings)
        hf_rates, our_rates, same = [], [], "n/a" if "n" in settings else True
        for _ in range(args.repeats):  # interleaved, so drift hits both sides
            t_hf, out_hf = run_hf(hf, prompts, counts, **settings)
            t_ours, out_ours = run_ours(ours, prompts, counts, **settings)
            hf_rates.append(useful / t_hf)
            our_rates.append(useful / t_ours)
            if same != "n/a":
                same = same and sum(a == b for a, b in zip(out_hf, out_ours)) == len(prompts)
        ratios = [o / h for o, h in zip(our_rates, hf_rates)]

        def cell(xs, fmt):
            return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

        print(
            f"{name:<8} {cell(hf_rates, '{:,.0f}'):>22} {cell(our_rates, '{:,.0f}'):>22} "
            f"{cell(ratios, '{:.2f}x'):>22}  {same if same == 'n/a' else 'yes' if same else 'NO'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
