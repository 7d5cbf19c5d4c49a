"""The paged engine from Python: load the shipped model, build the engine, serve a few requests, print them.

python example.py
"""

from ext import ServingEngine
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
from harness.tuning import prepare
from scheduler import PagedEngine
from sequence import Request, SamplingParams

# prepare: the process's settings, and on a CPU the linears packed for oneDNN (ext/tuning.py); engines touch neither
model = prepare(load_checkpoint(SHIPPED))
enc = get_tokenizer(model.config.vocab_size)

# the core: 256 blocks of 16 tokens, greedy and sampled requests in the same steps
engine = PagedEngine(model, num_blocks=256, block_size=16)
requests = [
    Request(enc.encode("ROMEO:\n"), 48),  # greedy
    Request(enc.encode("JULIET:\n"), 48, SamplingParams(temperature=0.8, top_k=200, seed=1)),
]
engine.run(requests)
for r in requests:
    print(f"--- {r.params}\n{enc.decode(r.prompt + r.generated)}")

# every extension: n samples forked from one prefill, beam search, swap, CUDA graphs (ext/__init__.py)
engine = ServingEngine(model, num_blocks=256, swap_blocks=64)
request = Request(enc.encode("HAMLET:\n"), 32, SamplingParams(temperature=0.8, top_k=200, seed=1, n=2))
engine.run([request])
for s in request.sequences:
    print(f"--- sample seeded {s.seed}\n{enc.decode(s.tokens)}")
