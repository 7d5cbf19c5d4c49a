"""Where does speculative decoding by prompt lookup pay? The trained tiny model on held-out Shakespeare prompts of
64 tokens, 128 new each, greedy, float32: the engine with --num-speculative-tokens k (1, 2, 4, 8 and auto)
against the same engine without, at batch 1, 8 and 64 (max_batch; max(batch, 8) requests a run), each pair
alternated in one process, repeated; outputs checked token for token against plain decoding. Then, at batch 1,
Hugging Face's generate(prompt_lookup_num_tokens=k) on the same weights against its plain greedy generate, and
ours against it.

    python bench/speculation.py [--repeats 3] [--batches 1,8,64] [--ks 1,2,4,8,auto] [--plot out/speculation.png]
                                [--new-tokens 128]
    python bench/speculation.py --batches 1 --ks 4 --hf-ks "" --vllm-python .vllm/bin/python --vllm-ks 4

With --vllm-python, also vLLM's ngram speculation (speculative_config method "ngram", prompt_lookup_max 3) at
batch 1 (max_num_seqs 1) against vLLM's plain greedy decoding, each run its own process, both cores bound to it
(VLLM_CPU_OMP_THREADS_BIND=0-1), float32, on the shipped model exported by export_hf (harness/checkpoints.py);
and ours against it.

Each side is the engine `generate.py --paged` builds: PagedEngine, with the speculation extension
(ext/speculative.py) where k is asked for and, with --compile step, the compiled small steps (ext/compiled_steps.py).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import engine_class
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint, shakespeare, to_transformers
from harness.metrics import Meter, speculation
from harness.tuning import prepare
from sequence import Request

PROMPT_TOKENS, NEW_TOKENS = 64, 128  # --new-tokens sets NEW_TOKENS


def prompts(n, seed=1):
    """n windows of PROMPT_TOKENS tokens cut from the held-out plays."""
    val = get_tokenizer(2048).encode_ordinary(shakespeare()[1])
    rng = random.Random(seed)
    starts = [rng.randrange(len(val) - PROMPT_TOKENS) for _ in range(n)]
    return [val[s : s + PROMPT_TOKENS] for s in starts]


def run_ours(model, batch_prompts, batch, k, compile):
    """-> (seconds, outputs, speculation's figures)."""
    speculating = dict(num_speculative_tokens=k) if k else {}
    cls = engine_class(speculative=bool(k), compile=compile)
    engine = cls(model, num_blocks=2048, max_batch=batch, compile=compile, **speculating)
    meter = Meter(engine)
    requests = [Request(p, NEW_TOKENS) for p in batch_prompts]
    start = time.perf_counter()
    engine.run(requests)
    seconds = time.perf_counter() - start
    stats = meter.proposed_tokens, meter.accepted_tokens, meter.verify_steps
    return seconds, [r.generated for r in requests], speculation(*stats)


@torch.no_grad()
def run_hf(hf, batch_prompts, k):
    """One prompt at a time (prompt lookup takes batch 1) -> (seconds, outputs)."""
    outputs, start = [], time.perf_counter()
    for p in batch_prompts:
        lookup = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=3) if k else {}
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **lookup
        )
        outputs.append(out[0, len(p) :].tolist())
    return time.perf_counter() - start, outputs


def fmt(xs):
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main():
    global NEW_TOKENS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--ks", default="1,2,4,8,auto")
    p.add_argument("--hf-ks", default="2,4", help="HF's prompt_lookup_num_tokens to run at batch 1 ('' for none)")
    p.add_argument(
        "--compile",
        default="auto",
        help="ours: the engine's --compile, or several (auto,step): a table each, alternated",
    )
    p.add_argument("--plot", help="draw tok/s against k, one line per batch, to this image file")
    p.add_argument("--vllm-python", help="the python of vLLM's own virtualenv: run its ngram speculation too")
    p.add_argument("--vllm-ks", default="4", help="vLLM's num_speculative_tokens to run at batch 1")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="each request's (16 and --repeats 1: a check)")
    p.add_argument("--vllm-worker", nargs=3, help=argparse.SUPPRESS)  # folder, prompts file, k
    args = p.parse_args()
    NEW_TOKENS = args.new_tokens
    if args.vllm_worker:
        return vllm_worker(*args.vllm_worker)
    model = prepare(load_checkpoint(SHIPPED))
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(
        f"$ python bench/speculation.py --repeats {args.repeats} --batches {args.batches} --ks {args.ks} "
        f"--hf-ks '{args.hf_ks}' --compile {args.compile} --new-tokens {NEW_TOKENS}"
    )
    print(f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; the shipped model, float32, greedy")  # fmt: skip
    ks = [k if k == "auto" else int(k) for k in args.ks.split(",")]
    compiles = args.compile.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    for compile in compiles:  # warm-up: compile="step"'s graph, and decode attention's where 16 rows decode
        run_ours(model, prompts(2), 1, 4, compile)
        if max(batches) >= 16:
            run_ours(model, prompts(16), max(batches), 0, compile)
    curves = {}
    for batch, compile in [(b, c) for b in batches for c in compiles]:
        batch_prompts = prompts(max(batch, 8))
        tokens = len(batch_prompts) * NEW_TOKENS
        print(
            f"--- batch {batch}, compile {compile}: {len(batch_prompts)} requests of "
            f"{PROMPT_TOKENS} + {NEW_TOKENS} tokens"
        )
        print(
            "| k | plain tok/s | speculative tok/s | speculative / plain | accepted | tokens per verify step | same |"
        )
        print("|---|---|---|---|---|---|---|")
        for k in ks:
            plain, spec, same, figures = [], [], True, None
            for _ in range(args.repeats):
                seconds, want, _ = run_ours(model, batch_prompts, batch, 0, compile)
                plain.append(seconds)
                seconds, got, figures = run_ours(model, batch_prompts, batch, k, compile)
                spec.append(seconds)
                same = same and got == want
            ratios = [a / b for a, b in zip(plain, spec)]
            curves.setdefault((batch, compile), []).append(
                (k, tokens / statistics.median(spec), tokens / statistics.median(plain))
            )
            accepted = "-" if figures["spec_acceptance_pct"] is None else f"{figures['spec_acceptance_pct']:.0f}%"
            per_step = figures["spec_tokens_per_verify"]
            print(
                f"| {k} | {tokens / statistics.median(plain):,.0f} | {tokens / statistics.median(spec):,.0f} | "
                f"{fmt(ratios)} | {accepted} | {'-' if per_step is None else f'{per_step:.2f}'} | {same} |",
                flush=True,
            )
    if args.hf_ks:
        hf_table(model, [int(k) for k in args.hf_ks.split(",")], args.repeats, compiles)
    if args.vllm_python:
        vllm_table(model, args.vllm_python, [int(k) for k in args.vllm_ks.split(",")], args.repeats, compiles)
    if args.plot:
        plot(curves, args.plot)


def hf_table(model, ks, repeats, compiles):
    """Batch 1: HF's prompt lookup against its plain greedy generate, and ours (speculating) against HF's."""
    hf = to_transformers(model)
    batch_prompts = prompts(8)
    run_hf(hf, batch_prompts[:1], ks[0])
    print(f"--- batch 1, Hugging Face transformers generate: {len(batch_prompts)} prompts, one at a time")
    peer_rows(
        model, batch_prompts, ks, repeats, compiles, "HF", "HF prompt lookup", lambda k: run_hf(hf, batch_prompts, k)
    )


def peer_rows(model, batch_prompts, ks, repeats, compiles, peer, speculating_name, run_peer):
    """For each k, alternated: the peer plain (run_peer(0)), the peer speculating (run_peer(k)) and ours at batch 1
    in each compile mode -> a table row each: tok/s of them all, ours / the peer speculating, and whether every
    output equals the peer's plain."""
    tokens = len(batch_prompts) * NEW_TOKENS
    ours_cells = [f"ours, compile {c}, tok/s | ours ({c}) / {speculating_name}" for c in compiles]
    print(f"| k | {peer} plain tok/s | {speculating_name} tok/s | {' | '.join(ours_cells)} | same |")
    print("|---" * (4 + 2 * len(compiles)) + "|")
    for k in ks:
        plain, speculating, ours, same = [], [], {c: [] for c in compiles}, True
        for _ in range(repeats):
            seconds, want = run_peer(0)
            plain.append(seconds)
            seconds, got = run_peer(k)
            speculating.append(seconds)
            same = same and got == want
            for c in compiles:
                seconds, got, _ = run_ours(model, batch_prompts, 1, k, c)
                ours[c].append(seconds)
                same = same and got == want
        cells = [f"{tokens / statistics.median(xs):,.0f}" for xs in (plain, speculating)]
        for c in compiles:
            cells += [f"{tokens / statistics.median(ours[c]):,.0f}", fmt([p / o for p, o in zip(speculating, ours[c])])]
        print(f"| {k} | {' | '.join(cells)} | {same} |", flush=True)


def vllm_worker(folder, prompts_file, k):
    """In vLLM's virtualenv: the prompts one at a time (max_num_seqs 1), greedy, after one warm-up request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(k)
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    llm = LLM(
        model=folder,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.5,
        max_num_seqs=1,
        **(spec if k else {}),
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True)
    with open(prompts_file) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    llm.generate(prompts[:1], params, use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps(dict(seconds=seconds, outputs=[list(o.outputs[0].token_ids) for o in out])))


def run_vllm(vllm_python, folder, prompts_file, k):
    cmd = [vllm_python, os.path.abspath(__file__), "--vllm-worker", folder, prompts_file, str(k)]
    cmd += ["--new-tokens", str(NEW_TOKENS)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(folder), check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.exit(f"error: the vLLM worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    return result["seconds"], result["outputs"]


def vllm_table(model, vllm_python, ks, repeats, compiles):
    """Batch 1: vLLM's ngram speculation against its plain greedy decoding, and ours (speculating) against it."""
    from harness.checkpoints import export_hf

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out", "speculation")
    folder, prompts_file = os.path.join(root, "hf"), os.path.join(root, "prompts.json")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        os.makedirs(root, exist_ok=True)
        export_hf(model, folder)
    batch_prompts = prompts(8)
    with open(prompts_file, "w") as f:
        json.dump(batch_prompts, f)
    print(f"--- batch 1, vLLM (its CPU build): {len(batch_prompts)} prompts, max_num_seqs 1, each run its own process")
    run = lambda k: run_vllm(vllm_python, folder, prompts_file, k)
    peer_rows(model, batch_prompts, ks, repeats, compiles, "vLLM", "vLLM ngram", run)


def plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (batch, compile), points in curves.items():
        numeric = [(k, spec, plain) for k, spec, plain in points if k != "auto"]
        label = f"batch {batch}" if len({c for _, c in curves}) == 1 else f"batch {batch}, compile {compile}"
        line = ax.plot([k for k, _, _ in numeric], [s / p for _, s, p in numeric], marker="o", label=label)
        auto = [s / p for k, s, p in points if k == "auto"]
        if auto:
            ax.scatter([0], auto, marker="*", s=120, color=line[0].get_color())
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("proposed tokens k (star at 0: auto)")
    ax.set_ylabel("tok/s, speculative / plain")
    ax.set_title(f"prompt-lookup speculation, the tiny model, {PROMPT_TOKENS} + {NEW_TOKENS} tokens, greedy, CPU")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
