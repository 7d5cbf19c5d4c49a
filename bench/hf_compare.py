"""--paged against Hugging Face transformers' GPT2LMHeadModel.generate on the same weights and prompts.

    pip install transformers          # benchmark-only; not in requirements.txt
    python bench/hf_compare.py [--repeats 3] [--threads N]

Random GPT-2-shaped weights (4 layers, 128 wide, 4 heads, GPT-2's vocabulary padded to 50,304 as nanoGPT
does, 512 context) are saved as a nanoGPT checkpoint, loaded by our loader and copied into transformers'
GPT-2. 64 prompts of 16-200 tokens are cut from the held-out plays (seed 1), decoded greedily, and:
  equal:  64 new tokens each (HF's best case: one left-padded batch, nothing wasted)
  mixed:  8-128 new tokens each (HF runs the whole batch to the longest; only useful tokens count)
HF and ours alternate in one process, repeated; each row is a median with min-max, the ratio per repeat.
Both sides never emit ids 50,257-50,303 (not tokens); outputs are checked token for token.
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model import GPT, GPTConfig  # noqa: E402
from scheduler import Request, Scheduler  # noqa: E402
from train_tiny import get_tokenizer, load_checkpoint, shakespeare  # noqa: E402


def make_models(path):
    torch.manual_seed(0)
    config = GPTConfig(block_size=512, vocab_size=50304, n_layer=4, n_head=4, n_embd=128)
    torch.save({"model": GPT(config).state_dict(), "model_args": vars(config)}, path)
    ours = load_checkpoint(path)
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50304, n_positions=512, n_embd=128, n_layer=4, n_head=4,
                                    activation_function="gelu", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    state = {}
    for k, v in ours.state_dict().items():  # our Linear (out, in) -> HF's Conv1D (in, out)
        state[k] = v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None  # like ours, generate exactly the asked-for count
    return ours, hf.eval()


def workload(seed, n=64, news=(64, 64)):
    rng = random.Random(seed)
    enc = get_tokenizer(50304)
    val = enc.encode_ordinary(shakespeare()[1])
    prompts = []
    for _ in range(n):
        start, length = rng.randrange(len(val) - 200), rng.randint(16, 200)
        prompts.append(val[start:start + length])
    return prompts, [rng.randint(*news) for _ in range(n)]


@torch.no_grad()
def run_hf(hf, prompts, news):
    """One left-padded batch run to the longest request -> (seconds, outputs cut to each one's count)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news), do_sample=False,
                      pad_token_id=0, suppress_tokens=list(range(50257, 50304)))
    seconds = time.perf_counter() - start
    return seconds, [out[i, width:width + n].tolist() for i, n in enumerate(news)]


@torch.no_grad()
def run_ours(model, prompts, news):
    """The engine exactly as `generate.py --paged` builds it (defaults, pool sized to fit every request)."""
    requests = [Request(p, n) for p, n in zip(prompts, news)]
    num_blocks = sum(-(-(len(p) + n - 1) // 16) for p, n in zip(prompts, news))
    engine = Scheduler(model, num_blocks, num_tokens=50257)
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start, [r.generated for r in requests]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ckpt", default="out/bench_gpt2_random.pt")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
    ours, hf = make_models(args.ckpt)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'workload':<8} {'HF tok/s':>22} {'--paged tok/s':>22} {'paged / HF':>22}  same output")
    for name, news in [("equal", (64, 64)), ("mixed", (8, 128))]:
        prompts, counts = workload(1, news=news)
        useful = sum(counts)
        run_hf(hf, prompts[:4], counts[:4]), run_ours(ours, prompts[:4], counts[:4])  # warm-up
        hf_rates, our_rates, same = [], [], True
        for _ in range(args.repeats):  # interleaved, so drift hits both sides
            t_hf, out_hf = run_hf(hf, prompts, counts)
            t_ours, out_ours = run_ours(ours, prompts, counts)
            hf_rates.append(useful / t_hf)
            our_rates.append(useful / t_ours)
            same &= out_hf == out_ours
        ratios = [o / h for o, h in zip(our_rates, hf_rates)]

        def cell(xs, fmt):
            return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"
        print(f"{name:<8} {cell(hf_rates, '{:,.0f}'):>22} {cell(our_rates, '{:,.0f}'):>22} "
              f"{cell(ratios, '{:.2f}x'):>22}  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
