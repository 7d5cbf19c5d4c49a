"""Where a step's time goes, ours beside vLLM's CPU build: the same workload through both engines under
torch.profiler, one table per workload (issue #63).

    python bench/profile_compare.py --vllm-python .vllm/bin/python [--workloads tiny/decode,gpt2/mixed]
        [--dtype float32|bfloat16] [--setup plain|preloaded]
    python bench/profile_compare.py --ours-only        # ours alone: no vLLM needed (the tests run this)

Each workload is bench/vllm_compare.py's: the same exported random weights, the same prompt ids, greedy, a
4,096-token step budget, a warm-up on other prompts of the same lengths. Each engine runs in a process of its
own; vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that the profiler sees its model's ops, with both
cores bound to it (VLLM_CPU_OMP_THREADS_BIND=0-1) and, with --setup preloaded, tcmalloc and its libiomp5.so
preloaded as vLLM's CPU docs ask. The timed pass runs under torch.profiler (CPU activities), and every op's
self time (its own, its children's left out, so nothing counts twice) goes to one category by its name:
  GEMMs             linears and matrix products (aten's, oneDNN's, vLLM's own _C GEMMs)
  attention         prompt and decode attention: ours SDPA (prompt chunks, eager decode) and the compiled
                    gather-attend graph, or with --our-compile kernel the C kernel; vLLM's CPU attention ops
  K/V writes        the new tokens' K/V into the pool: ours index_copy_, vLLM's reshape_and_cache
  norms, element-wise   layer norms, GELU, adds, copies, indexing: every other op
  sampling          argmax, topk, softmax, cumsum, searchsorted, random draws (ours' greedy argmax runs in
                    numpy, which the profiler does not see: it lands in the host side, ~0.5 ms a step at 64 x 50k)
  host side         the rest of the pass's wall time: Python, scheduling, batch building, the profiler's own
Each category's time is per engine step (ours: Engine.step calls; vLLM: LLMEngine.step calls), and its share of
the pass. The profiler slows both engines alike but not evenly (it costs per op): read the categories against
each other, and bench/vllm_compare.py for speed. --top N also lists each engine's N slowest ops by self time.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_compare as vc

CATEGORIES = [  # (category, a regular expression its ops' lowercase names match), first match wins
    ("sampling", r"argmax|topk|softmax|cumsum|searchsorted|sort\b|multinomial|exponential|uniform|random|gumbel"),
    ("K/V writes", r"reshape_and_cache|kv_cache_update|index_copy"),
    ("attention", r"attention|attn|sdpa|paged"),
    ("GEMMs", r"addmm|::mm\b|bmm|matmul|linear|gemm|onednn|mkldnn|brgemm|dnnl"),
    ("norms, element-wise", r"."),
]
ORDER = [name for name, _ in CATEGORIES[::-1]] + ["host side"]
# What a compiled graph holds differs: ours compiles decode attention alone (--compile auto's gather-attend), vLLM
# compiles its model between its own ops (the norms, GELU and residual adds around its GEMMs and attention)
COMPILED = {"ours": "attention", "vllm": "norms, element-wise"}


def category(op_name, engine):
    name = op_name.lower()
    if "compiledfxgraph" in name or "compiled region" in name:
        return COMPILED[engine]
    return next(cat for cat, pattern in CATEGORIES if re.search(pattern, name))


def profile_pass(serve, prompts, new_tokens, count_steps):
    """serve(prompts, new_tokens) -> a function that serves them, run under torch.profiler -> its wall seconds,
    steps and ops' self times. What serve builds first (ours: the engine and its pool, zero-filled) is left out,
    as vLLM's LLM() allocates its KV cache before anything is served."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run = serve(prompts, new_tokens)
    steps = count_steps()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outputs = run()
        seconds = time.perf_counter() - start
    ops = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
    return dict(seconds=seconds, steps=steps(), ops=ops, outputs=outputs, threads=torch.get_num_threads())


def run_ours(job):
    sys.path.insert(0, vc.ROOT)
    import torch

    from ext import engine_class
    from harness.checkpoints import load_checkpoint
    from harness.tuning import prepare
    from paged import blocks_for
    from sequence import Request

    model = prepare(load_checkpoint(job["folder"]).to(getattr(torch, job["dtype"])))
    engine_type = engine_class(compile=job["compile"])
    if job["compile"] == "kernel":  # a ctypes call is no op the profiler sees: named here, so it counts as attention
        from ext import cpu_kernel

        kernel_attend = cpu_kernel.kernel_attend

        def named(*args):
            with torch.profiler.record_function("cpu_kernel::decode_attention"):
                return kernel_attend(*args)

        cpu_kernel.kernel_attend = named
    steps = [0]
    step = engine_type.step

    def counted(self):
        steps[0] += 1
        return step(self)

    engine_type.step = counted  # this process's engine class only: composed for this run

    def serve(prompts, new_tokens):
        num_blocks = sum(blocks_for(len(p) + new_tokens, 16) for p in prompts)
        kw = dict(num_blocks=num_blocks, token_budget=4096, max_batch=64, vocab_size=50257, compile=job["compile"])
        engine = engine_type(model, **kw)
        requests = [Request(p, new_tokens) for p in prompts]

        def run():
            engine.run(requests)
            return [r.generated for r in requests]

        return run

    serve(job["warm"], min(job["new"], 8))()  # compiles decode attention where the run will use it

    def count_steps():
        first = steps[0]
        return lambda: steps[0] - first

    return profile_pass(serve, job["timed"], job["new"], count_steps)


def run_vllm(job):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["folder"], skip_tokenizer_init=True, dtype=job["dtype"], seed=0, gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    steps = [0]
    step = engine.step

    def counted(*args, **kw):
        steps[0] += 1
        return step(*args, **kw)

    engine.step = counted

    def serve(prompts, new_tokens):
        params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)

        def run():
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return [list(r.outputs[0].token_ids) for r in results]

        return run

    serve(job["warm"], min(job["new"], 8))()

    def count_steps():
        first = steps[0]
        return lambda: steps[0] - first

    return profile_pass(serve, job["timed"], job["new"], count_steps)


def table(name, results, top):
    """One workload's table: each category's ms per step and share of the pass, per engine."""
    names = list(results)
    lines = [f"-- {name}: " + "; ".join(f"{n} {r['steps']} steps in {r['seconds']:.2f} s" for n, r in results.items())]
    lines.append(f"{'':22}" + "".join(f"{n + ' ms/step':>22}{'share':>8}" for n in names))
    by_category = {}
    for n, r in results.items():
        times = dict.fromkeys(ORDER, 0.0)
        for op, (seconds, _) in r["ops"].items():
            times[category(op, n)] += seconds
        times["host side"] = max(0.0, r["seconds"] - sum(times.values()))
        by_category[n] = times
    for cat in ORDER:
        row = f"{cat:22}"
        for n, r in results.items():
            seconds = by_category[n][cat]
            row += f"{1000 * seconds / max(r['steps'], 1):>22.3f}{seconds / r['seconds']:>8.0%}"
        lines.append(row)
    if len(names) == 2:
        a, b = (results[n]["outputs"] for n in names)
        lines.append(f"the same greedy outputs: {sum(x == y for x, y in zip(a, b))}/{len(a)}")
    for n, r in results.items():
        if top:
            lines.append(f"{n}'s {top} slowest ops by self time (s, calls, category):")
            slowest = sorted(r["ops"].items(), key=lambda kv: -kv[1][0])[:top]
            lines += [f"    {seconds:8.3f} {count:7d}  {op}  [{category(op, n)}]" for op, (seconds, count) in slowest]
    return "\n".join(lines)


def launch(python, kind, job_file, env):
    """A worker of this script in a process of its own -> its result."""
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--worker-job", job_file]
    proc = subprocess.run(cmd, check=False, env={**os.environ, **env}, capture_output=True, text=True, cwd=vc.ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"error: {kind} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=".vllm/bin/python", help="the python of vLLM's own virtualenv")
    p.add_argument("--workloads", default="tiny/decode,gpt2/mixed,gpt2/decode,gpt2/prefill")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--setup", default="preloaded", choices=["plain", "preloaded"], help="vLLM's (vllm_compare's)")
    p.add_argument("--ours-only", action="store_true", help="profile ours alone: no vLLM")
    p.add_argument(
        "--our-compile",
        default="auto",
        choices=["auto", "kernel"],
        help="ours' --compile: kernel runs decode attention through the C kernel (ext/cpu_kernel.py), timed as an op",
    )
    p.add_argument("--num-requests", type=int, help="fewer requests than the workload's (a quick check)")
    p.add_argument("--top", type=int, default=8, help="list each engine's N slowest ops (0: none)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-job", help=argparse.SUPPRESS)
    return p


def main():
    args = parser().parse_args()
    if args.worker:
        with open(args.worker_job) as f:
            job = json.load(f)
        result = (run_ours if args.worker == "ours" else run_vllm)(job)
        print("RESULT " + json.dumps(result), flush=True)
        return
    print(f"python bench/profile_compare.py {' '.join(sys.argv[1:])}")
    print(f"{vc.cpu_line()}; dtype {args.dtype}; {time.strftime('%Y-%m-%d %H:%M')}")
    engines = {"ours": (sys.executable, {})}
    if not args.ours_only:
        engines["vllm"] = (args.vllm_python, {**vc.setups(args.vllm_python, [args.setup])[f"vllm {args.setup}"]})
        engines["vllm"][1]["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name in args.workloads.split(","):
        shape, key, beams, samples = vc.parse(name)
        assert beams == samples == 1, f"{name}: greedy workloads only (mixed, decode, prefill)"
        timed, warm = vc.prompts_for(key, 1), vc.prompts_for(key, 2)
        if args.num_requests:
            timed, warm = timed[: args.num_requests], warm[: args.num_requests]
        job = dict(folder=vc.export(shape), dtype=args.dtype, new=vc.WORKLOADS[key][2], timed=timed, warm=warm)
        job["compile"] = args.our_compile
        job_file = os.path.join(vc.ROOT, "out", "vllm_compare", "profile_job.json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        results = {engine: launch(python, engine, job_file, env) for engine, (python, env) in engines.items()}
        print(table(name, results, args.top), flush=True)


if __name__ == "__main__":
    main()
