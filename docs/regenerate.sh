#!/usr/bin/env bash
# Regenerate the figures and tables in docs/runs/ that the README and docs/ show (about 12 minutes on 2 CPU cores
# for generate.py's, and about 50 more for the benchmarks: each long one says its own time below). Not here: the
# benchmarks that need another virtualenv (vllm_compare.py, hf_compare.py, bf16_quality.py beside vLLM), a GPU
# (gpu.py), or whose files name the CPU they ran on (gemm_bound.py, decode_attention.py, host_step.py,
# speculation.py); bench/README.md gives their commands. tests/test_bench_scripts.py checks that every command
# here parses with today's flags.
# The README's own example commands write to out/ instead, so trying them never touches tracked files.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { name=$1; shift; echo "python generate.py $*" > "docs/runs/$name.txt"; python generate.py "$@" >> "docs/runs/$name.txt"; }
bench() { name=$1; shift; echo "python bench/$*" > "docs/runs/$name.txt"; python "bench/$@" >> "docs/runs/$name.txt"; }
run compare_mixed --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --seed 1 \
    --plot docs/runs/compare_mixed.png --json docs/runs/compare_mixed.json
run compare_prefix --compare --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --plot docs/runs/compare_prefix.png --json docs/runs/compare_prefix.json
run kv_budget --compare --kv-budget 4096 --num-requests 256 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --plot docs/runs/kv_budget.png --json docs/runs/kv_budget.json
run rate_sweep --compare --kv-budget 4096 --num-requests 150 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --sweep-rates 10,15,20,30,40,60 --plot docs/runs/rate_sweep.png --json docs/runs/rate_sweep.json
# the vLLM paper's Sec. 7.2 and 7.3 (about a minute each; one thread keeps them steady on a shared machine)
run block_size --sweep-block-sizes 1,2,4,8,16,32,64,128,256 --num-requests 128 --request-rate 256 --kv-budget 2048 \
    --threads 1 --seed 1 --plot docs/runs/block_size.png --json docs/runs/block_size.json
run swap --sweep-preemption 1,2,4,8,16,32,64,128,256 --num-requests 64 --request-rate 256 --kv-budget 1024 \
    --threads 1 --seed 1 --plot docs/runs/swap.png --json docs/runs/swap.json
# the block pool over three runs (each a few seconds)
python generate.py --paged --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --num-blocks 256 --pool-map docs/runs/pool_prefix.png
python generate.py --paged --num-requests 16 --num-beams 4 --prompt-len 16:64 --new-tokens 64:64 --seed 1 \
    --pool-map docs/runs/pool_beams.png
python generate.py --paged --num-requests 64 --prompt-len 8:128 --new-tokens 8:128 --seed 1 --num-blocks 96 \
    --pool-map docs/runs/pool_pressure.png
# the benchmarks
bench floor floor.py
bench fork_memory fork_memory.py --plot docs/runs/fork_memory.png
bench fork_memory_short_prompts fork_memory.py --prompt-len 8:32 --new-tokens 32:96
bench sampled_vs_greedy sampling.py                 # about 12 minutes
bench compiled_vs_eager_decode compile_cpu.py       # about 40 minutes on 2 cores: 12-layer, 768-wide models
