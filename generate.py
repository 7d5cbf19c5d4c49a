"""Serve prompts with a nanoGPT checkpoint, on the contiguous baseline or the paged engine, and run the
experiments that compare them on one seeded workload.

    python generate.py --paged                       # the shipped tiny Shakespeare model (models/)
    python generate.py --paged --prompt "ROMEO:" --num-samples 4
    python generate.py --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --plot out/mixed.png
    python generate.py --compare --kv-budget 4096 --num-requests 150 --sweep-rates 10,20,40 --plot out/sweep.png
    python generate.py --export-hf out/hf           # the checkpoint as a Hugging Face GPT-2, for transformers and vLLM
"""

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import torch

from ext import prepare
from ext.hf import export_hf
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
from harness.metrics import LABELS, returned, sweep_table, table
from harness.plots import PoolMap, plot, plot_block_sizes, plot_preemption
from harness.serving import (
    LENGTH_MIXES,
    MICRO_SEQUENCES,
    MICRO_TOKENS,
    make_engine,
    make_requests,
    serve,
    sweep_block_sizes,
    sweep_preemption,
    warm_up,
    workload,
)
from sequence import Request, RequestStatus


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows every flag's default, unless its help already says it."""

    def _get_help_string(self, action):
        return action.help if "(default:" in action.help else super()._get_help_string(action)


def fail(message):
    sys.exit(f"error: {message}")


def number_type(least=None, above=None, kind=int, allow_inf=False):
    """An argparse type: a finite number (or inf where allowed) at least `least` or above `above`."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) or (allow_inf and value == math.inf)):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (least is not None and not value >= least) or (above is not None and not value > above):
            raise argparse.ArgumentTypeError(
                f"{text} is below {least}" if least is not None else f"{text} must be above {above}"
            )
        return value

    return parse


def span(text):
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def rates(text):
    return [number_type(above=0, kind=float)(r) for r in text.split(",")]


def block_sizes(text):
    return [number_type(1)(b) for b in text.split(",")]


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
        "by default it runs to --max-new-tokens, as nanoGPT's sample.py",
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
    p.add_argument("--block-size", type=number_type(1), default=16, help="token slots per KV block")
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
        choices=["auto", "on", "off", "graph"],
        default="auto",
        help="paged decode attention through torch.compile (inductor). on: always; off: gather blocks + SDPA; "
        "graph: decode steps padded to fixed shapes, each captured once as a CUDA graph and replayed (on a CPU, "
        "padded without capture). auto: graph on CUDA; on a CPU, compiled for steps of 16 or more decode rows "
        "(measured as fast or faster). The one-time compile (~20 s, a few once cached) and capture are shown "
        "before the run",
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
        "and Alpaca's means scaled to the model (serving.LENGTH_MIXES), at --request-rate: normalized latency "
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


def parse_args(argv=None):
    """The flags, checked together: what needs what, what excludes what, and the paths written later."""
    args = parser().parse_args(argv)
    for flag, value, needs, present in [
        ("--reserve", args.reserve, "--kv-budget", args.kv_budget),
        ("--sweep-rates", args.sweep_rates, "--compare", args.compare),
        ("--num-blocks", args.num_blocks, "no --kv-budget", not args.kv_budget),
        ("--length-penalty", args.length_penalty != 1, "--num-beams", args.num_beams > 1),
        ("--pool-map", args.pool_map, "--paged, without --compare", args.paged and not args.compare),
        ("--preemption swap", args.preemption == "swap", "--swap-blocks N", args.swap_blocks),
        ("--swap-blocks", args.swap_blocks, "--preemption swap", args.preemption == "swap"),
        ("--sweep-preemption", args.sweep_preemption, "--kv-budget", args.kv_budget),
    ]:
        if value and not present:
            fail(f"{flag} needs {needs}")
    sweep = args.sweep_block_sizes or args.sweep_preemption
    if sweep:
        check_sweep(args, sweep)
    args.prompt_len = args.prompt_len or (16, 128)
    args.new_tokens = args.new_tokens or (16, 128)
    if args.num_beams > 1 and (args.num_samples > 1 or args.temperature or args.top_k or args.stop_at_eos):
        fail(
            f"--num-beams {args.num_beams} is greedy beam search to --max-new-tokens: it takes no --num-samples, "
            "--temperature, --top-k or --stop-at-eos"
        )
    args.temperature = (0.0 if args.num_beams > 1 else 0.8) if args.temperature is None else args.temperature
    args.top_k = 200 if args.top_k is None and args.num_beams == 1 else args.top_k
    if args.kv_budget and args.kv_budget < args.block_size:
        fail(f"--kv-budget {args.kv_budget} slots hold no block of --block-size {args.block_size}")
    workload_run = args.num_requests or sweep or (args.compare and not (args.prompt or args.prompts))
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


def check_sweep(args, sweep):
    """A sweep over block sizes draws its own workloads and runs the paged engine eager, or fails in one line."""
    flags = ["--sweep-block-sizes", "--sweep-preemption", "--compare", "--prompt-len", "--new-tokens", "--swap-blocks"]
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"))]
    if len(given) > 1:
        fail(f"{given[0]} draws its own workloads and engines: it takes no {', '.join(given[1:])}")
    if args.pool_map or args.prompt or args.prompts:
        fail(f"{given[0]} serves its own workloads: it takes no --pool-map, --prompt or --prompts")
    if args.compile in ("on", "graph"):  # dynamo would compile a graph per block size, past its limit of 8
        fail(f"{given[0]} runs decode attention eager: it takes no --compile {args.compile}")
    args.compile = "off"
    if args.kv_budget and args.kv_budget < max(sweep):
        fail(f"--kv-budget {args.kv_budget} slots hold no block of {max(sweep)}")


def check_image_name(flag, path):
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(path)[1][1:].lower() not in kinds:
        fail(f"{flag} {path}: the file name must end in one of .{', .'.join(sorted(kinds))}")


def prepare_output(flag, path):
    """Make the folder that `path` will be written to, if missing, or fail in one line: now, not after the run."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        fail(f"{flag} {path}: cannot make the folder {folder}: {e.strerror}")
    if not os.access(folder, os.W_OK):
        fail(f"{flag} {path}: the folder {folder} is not writable")


def read_prompts(args, enc):
    """The prompts as (texts, token lists, new-token counts), or exit with a one-line error."""
    if args.num_requests:
        try:
            prompts, news = workload(enc, args)
        except ValueError as e:
            fail(e)
        return [enc.decode(p) for p in prompts], prompts, news
    texts = list(args.prompt or [])
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                texts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        except OSError as e:
            fail(f"cannot read --prompts file {args.prompts}: {e.strerror}")
        except UnicodeDecodeError as e:
            fail(f"--prompts file {args.prompts} is not UTF-8 text: {e.reason} at byte {e.start}")
        if not texts:
            fail(f"--prompts file {args.prompts} holds no prompt")
    texts = texts or ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "KING LEAR:\n"]
    prompts = [enc.encode(t, allowed_special={"<|endoftext|>"}) for t in texts]  # Engine.add checks each
    return texts, prompts, [args.max_new_tokens] * len(prompts)


def outputs(r):
    return [s.generated for s in returned(r)]


def agreement(a, b):
    """The share of two outputs that is identical before their first difference: 1.0 when they are equal."""
    if a == b:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b))


def request_json(texts, requests, enc):
    done = []
    for i, r in enumerate(requests):
        if r.status is not RequestStatus.DONE:
            continue
        done.append(
            {
                "index": i,
                "prompt": texts[i],
                "prompt_tokens": r.prompt,
                "output_tokens": r.generated,
                "text": enc.decode(r.generated),
            }
        )
        if (
            r.params.n > 1 or r.params.num_beams > 1
        ):  # samples in order; beams best first, with HF's length-penalized score
            done[-1]["sequences"] = [
                dict(
                    output_tokens=s.generated,
                    text=enc.decode(s.generated),
                    seed=s.seed,
                    **(dict(score=s.score) if r.params.num_beams > 1 else {}),
                )
                for s in r.sequences
            ]
    return done


def load_model(args):
    """The checkpoint in --dtype, prepared (its linears prepacked for oneDNN on a CPU), and its tokenizer."""
    try:
        model = load_checkpoint(args.ckpt, args.device).to(getattr(torch, args.dtype))
        enc = get_tokenizer(model.config.vocab_size)
    except ValueError as e:
        fail(e)
    prepare(model)  # process settings, and CPU linears packed for oneDNN (ext/tuning.py)
    return model, enc


def choose_designs(args):
    """The engines to run: every design with --compare; else the one that --paged and --kv-budget name."""
    if args.compare:
        kinds = ["contiguous_max", "contiguous_pow2", "contiguous_oracle"] if args.kv_budget else ["contiguous"]
        return kinds + ["paged", "paged_prefix"]
    if args.paged:
        return ["paged" if args.no_prefix_cache else "paged_prefix"]
    return ["contiguous_" + (args.reserve or "max") if args.kv_budget else "contiguous"]


def run_designs(model, kinds, args, prompts, news, vocab_size, results):
    """Warm every design up untimed, then serve the workload with each, at each rate. results fills in as
    runs finish, so that an interrupt keeps them."""
    for kind in kinds:  # untimed: first calls pay one-time setup, which would bias the first design run
        engine = make_engine(model, kind, args, prompts, news, vocab_size)
        for r in make_requests(args, prompts, news):  # refuse what can never run before compiling anything
            engine.check(r)
        warm_up(engine, len(prompts) * max(args.num_samples, args.num_beams))
        make_engine(model, kind, args, prompts, news, vocab_size).run([Request(p[:16], 2) for p in prompts[:2]])
    for rate in args.sweep_rates or [args.request_rate]:
        results.runs = {}
        for kind in kinds:
            engine = make_engine(model, kind, args, prompts, news, vocab_size)
            results.requests = make_requests(args, prompts, news)
            results.pool_map = PoolMap(engine) if args.pool_map else None  # --paged: one design
            results.runs[kind], results.steps[kind] = serve(engine, results.requests, args, rate)
            if kind == kinds[0]:
                first = results.requests
            else:  # token for token against the first run, on the same workload
                pairs = list(zip(results.requests, first))
                same = sum(outputs(r) == outputs(f) for r, f in pairs)
                results.runs[kind]["same_output_pct"] = 100 * same / len(first)
                shares = [agreement(a, b) for r, f in pairs for a, b in zip(outputs(f), outputs(r))]
                results.runs[kind]["same_prefix_pct"] = 100 * sum(shares) / len(shares)
        results.sweep.append({"request_rate": rate, "runs": results.runs})
        if args.sweep_rates:
            print(f"--- request rate {rate:g}/s\n{table(results.runs)}", flush=True)


def report(args, kinds, texts, prompts, results, enc):
    """Print the samples or the table, and write the JSON and the plot."""
    runs, requests = results.runs, results.requests
    workload_name = (
        f"{len(prompts)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.new_tokens[0]}-{args.new_tokens[1]} new"
        if args.num_requests
        else f"{len(prompts)} prompts"
    )
    if args.kv_budget:
        workload_name += f", KV budget {args.kv_budget:,} slots"
    if not args.num_requests and not args.compare:
        for i, r in enumerate(requests):
            for j, s in enumerate(returned(r)):
                which = f", sample {j} (seed {s.seed})" if r.params.n > 1 else ""
                which += (
                    f", best of {r.params.num_beams} beams (score {r.sequences[0].score:.4f})"
                    if r.params.num_beams > 1
                    else ""
                )
                print(f"--- request {i}{which}, {len(s.generated)} new tokens\n{texts[i]}{enc.decode(s.generated)}")
        m = runs[kinds[0]]
        print(
            f"--- {LABELS[kinds[0]]}: {m['output_tokens']:,} new tokens in {m['wall_s']:.2f} s, "
            f"{m['output_tok_s']:,.0f} tok/s ({args.device}, {args.dtype})"
        )
    if (args.num_requests or args.compare or args.metrics) and not args.sweep_rates:  # a sweep printed its tables
        print(f"--- {workload_name} on {args.device}, {args.dtype}\n{table(runs)}")
        if args.compare and args.dtype == "bfloat16":
            print(
                "in bfloat16 the designs round differently (their attention kernels and batch shapes differ), so "
                "outputs part after some tokens: same_output_pct checks the engine only in float32 and "
                "float64; same_prefix_pct is how much of each output agrees before it parts "
                "(docs/bf16.md#comparisons-in-bf16)"
            )
    for point in results.sweep:  # never silently: swap that fell back to recomputing says so, in one line
        for kind, m in point["runs"].items():
            if m.get("swap_fallbacks"):
                at = f" at {point['request_rate']:g} requests/s" if args.sweep_rates else ""
                print(
                    f"{LABELS[kind]}{at}: {m['swap_fallbacks']} preempted sequences were recomputed instead of swapped: "
                    f"the swap space of {m['swap_blocks']} blocks could not take their group"
                )
    if args.json:
        if args.sweep_rates:
            out = {"sweep": results.sweep}
        elif args.compare:
            out = {"runs": runs}
        else:
            out = {"metrics": runs[kinds[0]], "requests": request_json(texts, requests, enc)}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(results.steps, results.sweep if args.sweep_rates else None, args.plot, workload_name)
        print(f"plot written to {args.plot}")
    if args.pool_map:
        pool_map = results.pool_map
        num_blocks, steps = pool_map.engine.allocator.num_blocks, len(pool_map.states)
        pool_map.draw(args.pool_map, f"{workload_name}, {LABELS[kinds[0]]}: {num_blocks} blocks of {args.block_size}")
        print(f"pool map written to {args.pool_map}: {num_blocks} blocks over {steps} steps")


def run_sweep(model, enc, args):
    """--sweep-block-sizes or --sweep-preemption: the runs, their tables, JSON and plot."""
    kind = "paged" if args.no_prefix_cache else "paged_prefix"
    used = LENGTH_MIXES if args.sweep_block_sizes else ["ShareGPT"]
    mixes = ", ".join(f"{mix} prompts {LENGTH_MIXES[mix][0]}, new {LENGTH_MIXES[mix][1]}" for mix in used)
    budget = f"KV budget {args.kv_budget:,} slots" if args.kv_budget else "a pool that holds every request"
    setup = f"{args.num_requests} requests a run at {args.request_rate:g}/s, {budget}"
    where = f"{args.device}, {args.dtype}, {torch.get_num_threads()} threads"
    print(f"{setup}, seed {args.seed}; {mixes} tokens (MIN, MAX); {LABELS[kind]}, eager attention, {where}")
    if args.sweep_block_sizes:
        out = {"block_sizes": sweep_block_sizes(model, enc, args, kind)}
        print_block_sizes(out["block_sizes"])
        title = f"block size: ShareGPT's and Alpaca's mean lengths / 4; {setup}; {where}"
    else:
        out = {"preemption": sweep_preemption(model, enc, args, kind)}
        print_preemption(out["preemption"])
        title = f"recompute against swap: ShareGPT's mean lengths / 4; {setup}; {where}"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        (plot_block_sizes if args.sweep_block_sizes else plot_preemption)(next(iter(out.values())), args.plot, title)
        print(f"plot written to {args.plot}")


def print_block_sizes(results):
    columns = [("ms/token", "normalized_latency_ms"), ("output tok/s", "output_tok_s"), ("running", "running_mean")]
    columns += [("preemptions", "preemptions"), ("KV MB peak", "kv_allocated_peak_mb")]
    columns += [("tokens' MB", "kv_used_peak_mb")]
    for mix, runs in results.items():
        print(f"--- {mix}\n{sweep_table([(f'block size {b}', m) for b, m in runs.items()], columns)}")


def print_preemption(points):
    columns = [("swap out ms", "swap_out_ms"), ("swap in ms", "swap_in_ms"), ("recompute ms", "recompute_ms")]
    rows = [(f"block size {p['block_size']}", p) for p in points]
    print(f"--- {MICRO_SEQUENCES} sequences of {MICRO_TOKENS} tokens preempted and readmitted, medians of 3")
    print(sweep_table(rows, columns))
    rows = [(f"{mode}, block size {p['block_size']}", p[mode]) for p in points for mode in ("recompute", "swap")]
    columns = [
        ("ms/token", "normalized_latency_ms"),
        ("preemptions", "preemptions"),
        ("swapped out", "swapped_out_blocks"),
    ]
    columns += [("swap MB", "swap_mb"), ("swap out ms", "swap_out_ms"), ("swap in ms", "swap_in_ms")]
    columns += [("recomputed", "recomputed_tokens"), ("recompute ms", "recompute_ms")]
    print(f"--- ShareGPT mix under the KV budget, each preemption mode\n{sweep_table(rows, columns)}")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device} asked for, but this torch sees no CUDA GPU")
    if args.export_hf:  # no training on the way: exporting a checkpoint that is not there is an error
        try:
            export_hf(load_checkpoint(args.ckpt), args.export_hf)
        except ValueError as e:
            fail(e)
        print(
            f"exported {args.ckpt} to {args.export_hf}: config.json, model.safetensors, vocab.json, merges.txt, "
            "tokenizer_config.json"
        )
        return
    model, enc = load_model(args)
    args.eos = enc.eot_token if args.stop_at_eos else None
    if args.sweep_block_sizes or args.sweep_preemption:
        try:
            return run_sweep(model, enc, args)
        except ValueError as e:  # a block size whose pool holds no request
            fail(e)
    texts, prompts, news = read_prompts(args, enc)
    kinds = choose_designs(args)
    if args.kv_budget:
        c = model.config  # one slot: one token's K and V in every layer and head
        slot_bytes = 2 * c.n_layer * c.n_embd * model.lm_head.weight.element_size()
        print(
            f"KV budget: {args.kv_budget:,} slots x {slot_bytes:,} bytes = {args.kv_budget * slot_bytes / 2**20:,.1f} MB"
        )
    results = SimpleNamespace(sweep=[], runs={}, steps={}, requests=[])
    try:
        run_designs(model, kinds, args, prompts, news, enc.n_vocab, results)
    except ValueError as e:
        fail(e)
    except KeyboardInterrupt:  # keep what finished: the runs done, and the requests done in this one
        done = request_json(texts, results.requests, enc)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"interrupted": True, "runs": results.runs, "requests": done}, f, indent=1)
        fail(
            f"interrupted: {len(done)} of {len(results.requests)} requests of this run had finished"
            + (f"; they and the finished runs are in {args.json}" if args.json else "")
        )
    report(args, kinds, texts, prompts, results, enc)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # during loading; once serving, main keeps what finished
        sys.exit("interrupted before any request was served")
