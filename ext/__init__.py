"""The engine's extensions, each in a file of its own. Each subclasses the paged engine at methods the core names
(engine.py lists them), and does nothing until asked for:
    forks.py   n samples and beam search, with copy-on-write      (SamplingParams n > 1, num_beams > 1)
    swap.py    swap preemption to host memory                      (swap_blocks > 0)
    speculative.py  prompt-lookup speculative decoding             (num_speculative_tokens > 0 or "auto")
    logprobs.py  log-probabilities of sampled and prompt tokens      (SamplingParams logprobs, prompt_logprobs)
    cuda.py    one-copy staging and CUDA graphs of decode steps    (compile="graph", auto's on CUDA), with two
               switches on where a GPU measured them: async_steps.py (async_steps) and flex_decode.py
               (decode_attention)
    compiled_steps.py  small steps as one compiled graph on a CPU  (compile="step")
    cpu_kernel.py  decode attention and the sampler's draw in C kernels of our own, on a CPU  (compile="kernel")
    padded_chunks.py  short chunks after cached K/V attend in one call  (by speculative.py and logprobs.py)
    invariant.py  a batch-invariant forward on a CPU: a token's values whatever runs beside it  (invariant=True)

engine_class composes exactly the extensions a run asks for, so that a plain run is the bare PagedEngine;
ServingEngine has them all, each idle until asked for, and gives the core's tokens where the core runs:

    from ext import ServingEngine, engine_class
    engine = engine_class(forks=True, swap=True)(model, num_blocks=256, swap_blocks=64)
"""

import functools

from ext.compiled_steps import CompiledSteps
from ext.cpu_kernel import CpuKernel
from ext.cuda import CudaGraphs
from ext.forks import PagedForks
from ext.invariant import Invariant
from ext.logprobs import Logprobs
from ext.speculative import Speculative
from ext.swap import Swap
from scheduler import PagedEngine

__all__ = ["ServingEngine", "engine_class"]

# in the order they compose
EXTENSIONS = (Invariant, CompiledSteps, Speculative, PagedForks, Logprobs, Swap, CudaGraphs, CpuKernel)


def engine_class(*, forks=False, logprobs=False, swap=False, speculative=False, invariant=False, compile="auto"):
    """PagedEngine with the extensions asked for: forks (n samples or beams), logprobs, swap (a swap space),
    speculative (speculative decoding), invariant (a batch-invariant forward), and the one that brings compile
    mode "graph", "step" or "kernel". None asked: PagedEngine."""
    wanted = {
        Invariant: invariant,
        CompiledSteps: compile == "step",
        Speculative: speculative,
        PagedForks: forks,
        Logprobs: logprobs,
        Swap: swap,
        CudaGraphs: compile == "graph",
        CpuKernel: compile == "kernel",
    }
    return compose(*(extension for extension in EXTENSIONS if wanted[extension]))


@functools.cache
def compose(*extensions):
    """PagedEngine with these extensions first in its MRO: it accepts the compile modes of each. The same
    extensions give the same class."""
    if not extensions:
        return PagedEngine
    bases = (*extensions, PagedEngine)
    modes = [mode for base in bases for mode in getattr(base, "compile_modes", ())]
    name = "".join(extension.__name__ for extension in extensions) + "Engine"
    return type(name, bases, {"compile_modes": tuple(dict.fromkeys(modes))})


class ServingEngine(*EXTENSIONS, PagedEngine):
    """PagedEngine with every extension, each idle until asked for: the tests' and benchmarks' engine."""

    compile_modes = compose(*EXTENSIONS).compile_modes
