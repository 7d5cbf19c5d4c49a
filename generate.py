"""Serve prompts with a nanoGPT checkpoint, on the contiguous baseline or the paged engine, and run the
experiments that compare them on one seeded workload.

    python generate.py --paged                       # the shipped tiny Shakespeare model (models/)
    python generate.py --paged --prompt "ROMEO:" --num-samples 4
    python generate.py --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --plot out/mixed.png
    python generate.py --compare --kv-budget 4096 --num-requests 150 --sweep-rates 10,20,40 --plot out/sweep.png
    python generate.py --export-hf out/hf           # the checkpoint as a Hugging Face GPT-2, for transformers and vLLM
"""

import argparse
import math
import sys

import torch

from harness import experiments
from harness.checkpoints import SHIPPED
from harness.flags import (
    HelpFormatter,
    block_sizes,
    check_image_name,
    check_sweep,
    fail,
    number_type,
    prepare_output,
    rates,
    span,
    speculative_tokens,
)


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.error = lambda message: fail(message)  # one line, no usage dump
    p.add_argument(
        "--ckpt",
        default=SHIPPED,
        help="a nanoGPT ckpt.pt, or a Hugging Face GPT-2 folder (config.json and "
        "model.safetensors); the default ships with the code, python train_tiny.py remakes it in out/",
    )
    p.add_argument("--prompt", action="append", help="a prompt; repeatable (default: four speaker names)")
    p.add_argument("--prompts", help="a UTF-8 file with one prompt per line, \\n for a newline")
    p.add_argument(
        "--num-samples",
        type=number_type(1),
        default=1,
        help="samples per prompt: one prefill, then forks that share its blocks; sample i is seeded seed + i",
    )
    p.add_argument(
        "--num-beams",
        type=number_type(1),
        default=1,
        help="beam search with this many beams (greedy, as transformers' num_beams); prints the best",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end a sequence at <|endoftext|> (kept as its last token), as transformers and vLLM do; "
        "by default it runs to --max-new-tokens, as nanoGPT's sample.py. With --num-beams, a beam that ends is a "
        "finished hypothesis, as transformers' beam search",
    )
    p.add_argument(
        "--early-stopping",
        choices=["false", "true", "never"],
        default="false",
        help="with --num-beams and --stop-at-eos: when beam search stops, as transformers' early_stopping: true, "
        "once num_beams hypotheses have ended; false, once no live beam can beat them (its heuristic); never, "
        "the same judged at --max-new-tokens when --length-penalty is positive",
    )
    p.add_argument(
        "--length-penalty",
        type=number_type(kind=float),
        default=1.0,
        help="beam scores are divided by (new tokens) ** this, as transformers' length_penalty",
    )
    p.add_argument("--max-new-tokens", type=number_type(1), help="tokens generated per prompt (default: 100)")
    p.add_argument(
        "--temperature",
        type=number_type(0.0, kind=float),
        help="0 means greedy; with --num-beams it must be 0 (default: 0.8)",
    )
    p.add_argument(
        "--top-k", type=number_type(1), help="sample among the k likeliest tokens; none with --num-beams (default: 200)"
    )
    p.add_argument(
        "--top-p",
        type=number_type(above=0, kind=float),
        default=1.0,
        help="sample among the likeliest tokens while the probability before them is below this (after --top-k), "
        "as transformers' and vLLM's top_p; 1 keeps them all",
    )
    p.add_argument(
        "--min-p",
        type=number_type(0.0, kind=float),
        default=0.0,
        help="sample among the tokens at least this times as likely as the likeliest, as transformers' and vLLM's "
        "min_p; 0 keeps them all",
    )
    p.add_argument(
        "--logprobs",
        type=number_type(0),
        help="print each new token's log-probability and rank, and the N likeliest tokens' (raw: before "
        "temperature and any cut, as vLLM's logprobs; at most 20); in --json too",
    )
    p.add_argument("--seed", type=int, default=1337, help="seeds sampling, the workload and arrivals")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument(
        "--threads",
        type=number_type(1),
        help="torch's CPU threads (default: torch's own choice, one per core); 1 keeps timings steady on a machine "
        "whose cores other work shares",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float64"],
        help="model and KV dtype; float64 for exact equivalence checks",
    )
    p.add_argument("--max-batch", type=number_type(1), help="sequences running at once (default: 64; on CUDA 256)")
    p.add_argument("--json", help="write requests and metrics to this file")
    p.add_argument("--metrics", action="store_true", help="print the metrics table after plain generation")
    p.add_argument("--paged", action="store_true", help="serve with the paged engine (default: contiguous)")
    p.add_argument("--block-size", type=number_type(1), help="token slots per KV block (default: 16)")
    p.add_argument(
        "--num-blocks",
        type=number_type(1),
        help="KV blocks in the pool (default: every request at once; on CUDA at most 90%% of free memory)",
    )
    p.add_argument(
        "--token-budget",
        type=number_type(1),
        help="tokens per paged step, decode + prefill chunks: larger cuts time to first token, and stalls decodes "
        "longer behind a chunk (default: 512; on CUDA 4096)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="paged without sharing prompt blocks")
    p.add_argument(
        "--preemption",
        choices=["recompute", "swap"],
        default="recompute",
        help="what a paged preemption does with the victim's K/V: drop them, to recompute them when it comes back, "
        "or copy them to a swap space in host memory and back (blocks it shares with running sequences stay)",
    )
    p.add_argument(
        "--swap-blocks",
        type=number_type(0),
        default=0,
        help="blocks of the swap space, each of --block-size tokens, for --preemption swap",
    )
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off", "graph", "step", "kernel"],
        default="auto",
        help="paged decode attention through torch.compile (inductor). on: always; off: gather blocks + SDPA; "
        "auto: graph on CUDA; on a CPU, compiled for steps of 16 or more decode rows (measured as fast or faster). "
        "graph (ext/cuda.py): decode steps padded to fixed shapes, each captured once as a CUDA graph and replayed, "
        "with async steps and flex_attention in large batches (on a CPU, padded without capture). step "
        "(ext/compiled_steps.py, CPU): steps of at most 8 sequences of at most 16 tokens each (batch-1 decoding, "
        "speculative verify steps) as one compiled graph of the whole forward. kernel (ext/cpu_kernel.py, CPU): "
        "decode attention, each row's draw and logprobs' scores through C kernels of our own, built with the "
        "system's C compiler at first use (~1 s). "
        "The one-time compile (~20 s, a few once cached; for step ~60 s, ~35 s cached) and capture are shown "
        "before the run",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=speculative_tokens,
        default=0,
        help="speculative decoding by prompt lookup, as vLLM's ngram method: each decoding sequence proposes up to "
        "this many tokens that followed an earlier occurrence of its last tokens, verified in the same step; outputs "
        "equal plain decoding's. auto: 4 while at most 8 sequences decode, else none (docs/speculation.md)",
    )
    p.add_argument(
        "--prompt-lookup-max",
        type=number_type(1),
        help="the longest suffix prompt lookup matches (default: 3)",
    )
    p.add_argument("--kv-budget", type=number_type(1), help="KV token slots every design must live within")
    p.add_argument(
        "--reserve", choices=["max", "pow2", "oracle"], help="contiguous reservation under --kv-budget (default: max)"
    )
    p.add_argument(
        "--request-rate",
        type=number_type(above=0, kind=float, allow_inf=True),
        default=math.inf,
        help="Poisson arrivals per second; inf: all at once",
    )
    p.add_argument("--compare", action="store_true", help="every design on one workload: one table, one plot")
    p.add_argument(
        "--sweep-rates", type=rates, help="with --compare: comma-separated request rates, each run by every design"
    )
    p.add_argument(
        "--sweep-block-sizes",
        type=block_sizes,
        help="the paged engine at each of these comma-separated block sizes, on two length mixes with ShareGPT's "
        "and Alpaca's means scaled to the model (harness/serving.py's LENGTH_MIXES), at --request-rate: normalized latency "
        "and KV memory (the vLLM paper's Sec. 7.2); decode attention eager",
    )
    p.add_argument(
        "--sweep-preemption",
        type=block_sizes,
        help="at each of these comma-separated block sizes: the time to swap 16 sequences of 128 tokens out and "
        "back in against recomputing them, and the ShareGPT mix under --kv-budget with each --preemption, the "
        "swap space as large as the pool (the vLLM paper's Sec. 7.3); decode attention eager",
    )
    p.add_argument("--num-requests", type=number_type(1), help="serve a seeded workload cut from held-out text")
    p.add_argument("--prompt-len", type=span, help="workload prompt tokens, MIN:MAX (default: 16:128)")
    p.add_argument("--new-tokens", type=span, help="workload new tokens, MIN:MAX (default: 16:128)")
    p.add_argument("--shared-prefix", type=number_type(0), default=0, help="tokens every workload prompt starts with")
    p.add_argument("--plot", help="draw the runs (or the sweep) to this image file")
    p.add_argument(
        "--pool-map", metavar="FILE", help="with --paged: draw every block's state at every step to this image file"
    )
    p.add_argument(
        "--export-hf",
        metavar="DIR",
        help="write --ckpt as a Hugging Face GPT-2 folder (safetensors, tokenizer) and exit",
    )
    return p


PAGED = "--paged or --compare"
CONTIGUOUS = "the contiguous baseline: no --paged, or --compare"
DRAWN = "a drawn workload: --num-requests, or --compare without --prompt or --prompts"


def parse_args(argv=None):
    """The flags, checked together: what needs what, what excludes what, and the paths written later."""
    args = parser().parse_args(argv)
    sweep = args.sweep_block_sizes or args.sweep_preemption
    paged = args.paged or args.compare or sweep  # a run of the paged engine
    workload_run = args.num_requests or sweep or (args.compare and not (args.prompt or args.prompts))
    for flag, value, needs, present in [
        ("--reserve", args.reserve, "--kv-budget", args.kv_budget),
        ("--sweep-rates", args.sweep_rates, "--compare", args.compare),
        ("--num-blocks", args.num_blocks, "no --kv-budget", not args.kv_budget),
        ("--length-penalty", args.length_penalty != 1, "--num-beams", args.num_beams > 1),
        ("--early-stopping", args.early_stopping != "false", "--num-beams", args.num_beams > 1),
        ("--logprobs", args.logprobs is not None, "--paged", args.paged and not args.compare),
        ("--pool-map", args.pool_map, "--paged, without --compare", args.paged and not args.compare),
        ("--preemption swap", args.preemption == "swap", "--swap-blocks N", args.swap_blocks),
        ("--swap-blocks", args.swap_blocks, "--preemption swap", args.preemption == "swap"),
        ("--sweep-preemption", args.sweep_preemption, "--kv-budget", args.kv_budget),
        ("--num-speculative-tokens", args.num_speculative_tokens, PAGED, args.paged or args.compare),
        ("--prompt-lookup-max", args.prompt_lookup_max, "--num-speculative-tokens", args.num_speculative_tokens),
        # what only the paged engine reads, and what only a drawn workload reads: never silently ignored
        ("--block-size", args.block_size, PAGED, paged),
        ("--num-blocks", args.num_blocks, PAGED, paged),
        ("--token-budget", args.token_budget, PAGED, paged),
        ("--no-prefix-cache", args.no_prefix_cache, PAGED, paged),
        (f"--compile {args.compile}", args.compile != "auto", PAGED, paged),
        ("--preemption swap", args.preemption == "swap", PAGED, paged),
        ("--reserve", args.reserve, CONTIGUOUS, args.compare or not args.paged),
        ("--prompt", args.prompt, "no --num-requests, which draws its own prompts", not args.num_requests),
        ("--prompts", args.prompts, "no --num-requests, which draws its own prompts", not args.num_requests),
        ("--prompt-len", args.prompt_len, DRAWN, workload_run),
        ("--new-tokens", args.new_tokens, DRAWN, workload_run),
        ("--shared-prefix", args.shared_prefix, DRAWN, workload_run),
    ]:
        if value and not present:
            fail(f"{flag} needs {needs}")
    args.block_size = args.block_size or 16
    if sweep:
        check_sweep(args, sweep)
    args.prompt_len = args.prompt_len or (16, 128)
    args.new_tokens = args.new_tokens or (16, 128)
    beam_free = args.num_samples > 1 or args.temperature or args.top_k or args.top_p < 1 or args.min_p
    if args.num_beams > 1 and (beam_free or args.logprobs is not None):
        fail(
            f"--num-beams {args.num_beams} is greedy beam search, scored per beam: it takes no --num-samples, "
            "--temperature, --top-k, --top-p, --min-p or --logprobs"
        )
    if not args.top_p <= 1 or not args.min_p <= 1:
        fail(f"--top-p {args.top_p} and --min-p {args.min_p} must be at most 1")
    if (args.logprobs or 0) > 20:
        fail(f"--logprobs {args.logprobs} must be at most 20 (vLLM's default max_logprobs)")
    args.early_stopping = {"false": False, "true": True}.get(args.early_stopping, args.early_stopping)
    args.temperature = (0.0 if args.num_beams > 1 else 0.8) if args.temperature is None else args.temperature
    args.top_k = 200 if args.top_k is None and args.num_beams == 1 else args.top_k
    if paged and args.kv_budget and args.kv_budget < args.block_size:
        fail(f"--kv-budget {args.kv_budget} slots hold no block of --block-size {args.block_size}")
    if workload_run and args.max_new_tokens:
        fail("--max-new-tokens is for your own prompts; a --num-requests workload draws --new-tokens MIN:MAX")
    args.max_new_tokens = args.max_new_tokens or 100
    args.num_requests = args.num_requests or (64 if workload_run else None)
    for flag, path in [("--plot", args.plot), ("--pool-map", args.pool_map)]:
        if path:
            check_image_name(flag, path)
    for flag, path in [("--json", args.json), ("--plot", args.plot), ("--pool-map", args.pool_map)]:
        if path:
            prepare_output(flag, path)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kind, _, index = args.device.partition(":")
    if kind not in ("cpu", "cuda"):
        fail(f"--device {args.device}: this engine runs on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device} asked for, but this torch sees no CUDA GPU")
    if kind == "cpu" and index:
        fail(f"--device {args.device}: cpu takes no index")
    if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        fail(f"--device {args.device}: this machine's CUDA GPUs are cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if args.export_hf:
        return experiments.export(args)
    model, enc = experiments.load_model(args)
    args.eos = enc.eot_token if args.stop_at_eos else None
    if args.sweep_block_sizes or args.sweep_preemption:
        try:
            return experiments.run_sweep(model, enc, args)
        except ValueError as e:  # a block size whose pool holds no request
            fail(e)
    experiments.serve_prompts(model, enc, args)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # during loading; once serving, the run keeps what finished
        sys.exit("interrupted before any request was served")
