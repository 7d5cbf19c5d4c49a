"""The paged engine from Python: load the shipped model, build the engine, serve a few requests, print them.

python example.py
"""

from ext import engine_class
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
from harness.tuning import prepare
from scheduler import PagedEngine
from sequence import Request, SamplingParams

# prepare: the process's settings, and on a CPU the linears packed for oneDNN (harness/tuning.py); engines touch
# neither
model = prepare(load_checkpoint(SHIPPED))
enc = get_tokenizer(model.config.vocab_size)

# the core: 256 blocks of 16 tokens, greedy and sampled requests in the same steps; ids past the tokenizer's
# (nanoGPT pads GPT-2's 50,257 to 50,304: a checkpoint trained on GPT-2's vocabulary) are never sampled
engine = PagedEngine(model, num_blocks=256, block_size=16, vocab_size=enc.n_vocab)
requests = [
    Request(enc.encode("ROMEO:\n"), 48),  # greedy
    Request(enc.encode("JULIET:\n"), 48, SamplingParams(temperature=0.8, top_k=200, top_p=0.95, seed=1)),
]
engine.run(requests)
for r in requests:
    print(f"--- {r.params}\n{enc.decode(r.prompt + r.generated)}")

# the extensions a request needs, composed on the core (ext/__init__.py): n samples forked from one prefill, and
# each sampled token's log-probability with the 2 likeliest
engine = engine_class(forks=True, logprobs=True)(model, num_blocks=256, vocab_size=enc.n_vocab)
request = Request(enc.encode("HAMLET:\n"), 32, SamplingParams(temperature=0.8, top_k=200, seed=1, n=2, logprobs=2))
engine.run([request])
for s in request.sequences:
    first = [round(next(iter(entry.values())).logprob, 2) for entry in s.logprobs[:5]]
    print(f"--- sample seeded {s.seed}, its first tokens' logprobs {first}\n{enc.decode(s.tokens)}")
