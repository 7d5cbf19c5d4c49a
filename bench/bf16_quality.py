"""What bfloat16 costs in quality, on the shipped trained model (models/tiny-shakespeare.pt): each engine in
bf16 against its own float32, greedy, and the held-out loss in each dtype.

    python bench/bf16_quality.py                                      # ours only
    python bench/bf16_quality.py --vllm-python .vllm/bin/python       # and vLLM's CPU build beside it

Prompts: 64 cuts of 16-64 tokens from the held-out plays (seeded); 128 greedy tokens each. For each engine,
bf16 against float32: the share of each output that is identical before the first difference (mean over
prompts), and the outputs identical throughout. Greedy decoding in bf16 takes another branch at the first
near tie, after which the text is still Shakespeare-like but different: token equality is the wrong test
for bf16, and its agreement with float32 beside another engine's is the useful figure. Held-out loss:
the first 255 tokens of every whole 256-token window of the held-out plays, each token after the first
predicted from those before it; logits in the model's dtype, the loss in float32; vLLM's from its prompt
log-probabilities on the same windows. Ours is the engine `generate.py --paged --dtype bfloat16` builds: the
bare PagedEngine, its model through harness/tuning.py's prepare. --num-prompts N with a small N (prompts and
windows both) is a check that the script runs, not a measurement.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

from vllm_compare import cpu_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
NUM_PROMPTS, NEW_TOKENS = 64, 128
FOLDER = os.path.join(ROOT, "out", "bf16_quality", "hf")  # the shipped model exported for vLLM
JOB = os.path.join(ROOT, "out", "bf16_quality", "job.json")


def data(num_prompts, export):
    """num_prompts prompts and the held-out windows (as many, if fewer than all), as token ids; with `export`, the
    model exported once for vLLM."""
    from harness.checkpoints import SHIPPED, export_hf, get_tokenizer, load_checkpoint, shakespeare

    model = load_checkpoint(SHIPPED)
    val = get_tokenizer(model.config.vocab_size).encode_ordinary(shakespeare()[1])
    rng = random.Random(0)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(16, 64)
        start = rng.randrange(len(val) - length)
        prompts.append(val[start : start + length])
    T = model.config.block_size
    # vLLM must generate a token after the window, within the model's 256 positions: windows of 255 tokens
    windows = [val[i * T : (i + 1) * T - 1] for i in range(min(len(val) // T, num_prompts))]
    os.makedirs(os.path.dirname(FOLDER), exist_ok=True)
    if export and not os.path.exists(os.path.join(FOLDER, "model.safetensors")):
        export_hf(model, FOLDER)
    return prompts, windows


def run_ours(dtype, prompts, windows):
    import torch
    import torch.nn.functional as F

    from harness.checkpoints import SHIPPED, load_checkpoint
    from harness.tuning import prepare
    from scheduler import PagedEngine
    from sequence import Request

    model = load_checkpoint(SHIPPED).to(getattr(torch, dtype))
    prepare(model)
    engine = PagedEngine(model, num_blocks=len(prompts) * 13)  # 64 + 128 tokens: at most 13 blocks of 16
    requests = [Request(p, NEW_TOKENS) for p in prompts]
    engine.run(requests)
    total = count = 0
    with torch.no_grad():
        for i in range(0, len(windows), 64):
            w = torch.tensor(windows[i : i + 64])
            logits, _ = model(w[:, :-1])
            total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].reshape(-1), reduction="sum").item()
            count += w[:, 1:].numel()
    result = dict(outputs=[r.generated for r in requests], loss=total / count, windows=len(windows))
    return dict(result, threads=torch.get_num_threads(), version=torch.__version__)


def run_vllm(dtype, prompts, windows):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=FOLDER, skip_tokenizer_init=True, dtype=dtype, seed=0, gpu_memory_utilization=0.5)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)  # the log-probability of each prompt token
    total = count = 0
    for w, out in zip(
        windows, llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], scored, use_tqdm=False)
    ):
        for token, logprobs in zip(w[1:], out.prompt_logprobs[1:]):
            total -= logprobs[token].logprob
            count += 1
    return dict(outputs=[list(r.outputs[0].token_ids) for r in results], loss=total / count, windows=len(windows))


def agreement(a, b):
    """(mean share of each output identical before the first difference, outputs identical throughout)"""
    from harness.metrics import agreement as share  # --compare's same_prefix_pct, the same measure; main process only

    shares = [share(x, y) for x, y in zip(a, b)]
    return sum(shares) / len(shares), sum(x == y for x, y in zip(a, b))


def launch(python, engine, dtype):
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--dtype", dtype]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1") if engine == "vllm" else os.environ
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:  # vLLM may abort in its own teardown ("terminate called ...") after its result is out
        sys.exit(f"error: {engine} {dtype} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="the python of vLLM's own virtualenv; without it, ours only")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="and held-out windows, at most all")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        with open(JOB) as f:
            job = json.load(f)
        result = (run_ours if args.worker == "ours" else run_vllm)(args.dtype, job["prompts"], job["windows"])
        print("RESULT " + json.dumps(result), flush=True)
        return
    prompts, windows = data(args.num_prompts, export=bool(args.vllm_python))
    with open(JOB, "w") as f:
        json.dump(dict(prompts=prompts, windows=windows), f)
    engines = {"ours": sys.executable} | ({"vllm": args.vllm_python} if args.vllm_python else {})
    results = {(e, d): launch(python, e, d) for e, python in engines.items() for d in ("float32", "bfloat16")}
    vllm = " --vllm-python VLLM_PYTHON" if args.vllm_python else ""
    print(f"$ python bench/bf16_quality.py{vllm} --num-prompts {args.num_prompts}")
    ours = results["ours", "float32"]
    print(f"{cpu_line()}; {time.strftime('%Y-%m-%d')}; ours: torch {ours['version']}, {ours['threads']} threads")
    print(f"the shipped model, {len(prompts)} held-out prompts of 16-64 tokens, {NEW_TOKENS} greedy tokens each")
    for e in engines:
        share, same = agreement(results[e, "bfloat16"]["outputs"], results[e, "float32"]["outputs"])
        losses = ", ".join(f"{d} {results[e, d]['loss']:.4f}" for d in ("float32", "bfloat16"))
        print(
            f"  {e:<5} bf16 against its float32: {100 * share:.1f}% of each output identical before the first "
            f"difference (mean), {same}/{len(prompts)} identical throughout; held-out loss over "
            f"{results[e, 'float32']['windows']} windows: {losses}"
        )
    if "vllm" in engines:
        for d in ("float32", "bfloat16"):
            share, same = agreement(results["ours", d]["outputs"], results["vllm", d]["outputs"])
            print(
                f"  ours against vllm, both {d}: {same}/{len(prompts)} identical, "
                f"{100 * share:.1f}% before a difference"
            )


if __name__ == "__main__":
    main()
