"""The extensions, each in a file of its own, and the engine that composes them all. Each plugs in where the core
names it, and each does nothing until asked for, so ServingEngine runs what the bare PagedEngine runs, the same
token for token:
    forks.py   n samples and beam search, with copy-on-write      (SamplingParams n > 1, num_beams > 1)
    swap.py    swap preemption to host memory                      (swap_blocks > 0)
    speculative.py  prompt-lookup speculative decoding             (num_speculative_tokens > 0 or "auto")
    cuda.py    one-copy staging and CUDA graphs of decode steps    (compile="graph"; captured on CUDA)
    compiled_steps.py  small steps as one compiled graph on a CPU  (compile="step")
    tuning.py  prepacked CPU linears, the process's settings       (prepare(model), before the engine)
    hf.py      Hugging Face GPT-2 import and export

    from ext import ServingEngine, prepare
    engine = ServingEngine(prepare(model), num_blocks=256, swap_blocks=64)
"""

from ext.compiled_steps import CompiledSteps
from ext.cuda import CudaGraphs
from ext.forks import PagedForks
from ext.speculative import Speculative
from ext.swap import Swap
from ext.tuning import prepare
from scheduler import PagedEngine

__all__ = ["ServingEngine", "prepare"]


class ServingEngine(CompiledSteps, Speculative, PagedForks, Swap, CudaGraphs, PagedEngine):
    """PagedEngine with every extension: what generate.py serves with."""
