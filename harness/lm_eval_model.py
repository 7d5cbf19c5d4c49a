"""lm-eval's model interface on the paged engine: `--model nanogpt-paged` scores and generates through
harness/scoring.py's engine (PagedEngine with the logprobs extension), every request of a call at once. Importing
this module registers the class; lm_eval_run.py at the repository's root is lm-eval's command line with it."""

import logging

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from harness import scoring
from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
from model import GPT
from paged import blocks_for
from sequence import Request, SamplingParams, SequenceStatus

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")  # the generation kwargs the engine takes, but until


def check_model_args(unknown, dtype, sizes, switches):
    """Raise ValueError, in one line, for a model_arg nanogpt-paged does not take or cannot use."""
    if unknown:
        raise ValueError(
            f"unknown model_args {', '.join(sorted(unknown))}: nanogpt-paged takes ckpt, dtype, block_size, "
            "num_blocks, token_budget, max_batch, prefix_cache, compile, invariant, max_gen_toks"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    for name, value in sizes.items():
        if type(value) is not int or value < 1:  # the engine checks its own, after a default pool is sized
            raise ValueError(f"{name} {value!r} must be an integer >= 1")
    for name, value in switches.items():  # lm-eval reads true and false as booleans, any other word as a string
        if type(value) is not bool:
            raise ValueError(f"{name} {value!r} must be true or false")


def model_device(device):
    """lm-eval's device, or where none is given or CUDA is asked without a GPU, what this machine has (lm-eval's
    command line defaults to cuda:0, as its HF backend falls back)."""
    if not device or device.startswith("cuda") and not torch.cuda.is_available():
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@register_model("nanogpt-paged")
class NanoGPTPaged(TemplateLM):
    """A nanoGPT checkpoint (or a Hugging Face GPT-2 folder) served by the paged engine, for lm-eval.

    model_args: ckpt (a ckpt.pt or a GPT-2 folder, what harness.checkpoints.load_checkpoint reads, or a GPT; default
    the shipped models/tiny-shakespeare.pt), dtype (float32, bfloat16, float16, float64; default: the checkpoint's
    weights in float32, a GPT as it is), and the engine's settings: block_size (16), num_blocks (default: room for
    16 full windows), token_budget (harness.scoring's 2,048), max_batch (64), prefix_cache (true), compile
    ("auto"), invariant (false; true: every score the same to the bit whatever runs beside it, on a CPU:
    ext/invariant.py); max_gen_toks (256) for generation kwargs that name none. lm-eval's batch_size, max_batch_size and
    device are taken too: the first two change nothing (the engine's max_batch and token_budget batch), device
    places the model (cuda if torch sees one, else the CPU, as lm-eval's HF backend does with its default cuda:0).
    The tokenizer is harness.checkpoints.get_tokenizer(vocab_size): GPT-2's BPE cut to the model's ids,
    end-of-text its last; the logits of ids past it (nanoGPT's padding to 50,304) never count.

    As lm-eval's models (TemplateLM): an empty context is the end-of-text token; a pair's trailing context spaces
    move to the continuation; a pair longer than the model's window keeps its last tokens. Where ours differs from
    lm-eval's HF backend, and why:
    - loglikelihood keeps the last `window` tokens of context + continuation, HF's the last window + 1 (it feeds
      all but the last). The engine scores prompt tokens, each after the ones fed before it, so every token it
      scores is fed, and the window's first has nothing before it: a long pair has one token less of context,
      and a continuation may be window - 1 tokens (HF's: window; longer ones are refused in one line, as HF
      asserts). Pairs that fit the window score the same.
    - loglikelihood_rolling's windows are lm-eval's with max_seq_len window - 1 (HF's: window; its vLLM
      backend's: window - 2), for the same reason: each text's tokens are all scored once, a window's after
      fewer tokens of context than HF's.
    - is_greedy is every continuation token's rank being 1, as vLLM's: an id tied with the likeliest is not
      greedy, where HF's argmax takes the lowest tied id.
    - Log-probabilities are log_softmax of the logits in float32 at least (vLLM's raw logprobs); HF's take the
      model's dtype.
    - generate_until keeps the context whole and caps max_gen_toks at what the window leaves: the engine's
      window + 1 - context tokens (its last token is never fed back). HF and vLLM cut the context's left to
      window - max_gen_toks instead, which for a 256-token model and lm-eval's default of 256 new tokens leaves
      nothing (HF asserts). A context longer than the window is refused in one line: a context cut from the left
      loses the task's instructions without a word. An empty context is the end-of-text token (HF fails on one).
      Stop strings are checked on the decoded text after each step, and a sequence that shows one stops there;
      end-of-text stops it too. Sampling (do_sample with a temperature; top_k, top_p, min_p) is the engine's:
      each request seeded with seed (default 0) + its index among the call's requests, repeatable run to run.
    - Everything runs through the engine at once, in the order given (a question's choices after one another,
      so that the prefix cache serves their context's blocks); lm-eval's batch_size does not apply.

    Bad input is refused with a ValueError of one line before the engine takes any of a call's requests: an empty
    continuation, ids outside the tokenizer's, a context too long to generate after, unknown model_args or
    generation kwargs."""

    def __init__(
        self,
        ckpt=SHIPPED,
        dtype=None,
        block_size=16,
        num_blocks=None,
        token_budget=scoring.SCORING_TOKEN_BUDGET,
        max_batch=64,
        prefix_cache=True,
        compile="auto",
        invariant=False,
        max_gen_toks=256,
        device=None,
        batch_size=None,
        max_batch_size=None,
        **unknown,
    ):
        super().__init__()
        sizes = dict(block_size=block_size, token_budget=token_budget, max_batch=max_batch, max_gen_toks=max_gen_toks)
        sizes["num_blocks"] = 1 if num_blocks is None else num_blocks
        check_model_args(unknown, dtype, sizes, dict(prefix_cache=prefix_cache, invariant=invariant))
        model = ckpt if isinstance(ckpt, GPT) else load_checkpoint(str(ckpt), model_device(device))
        self.model = model.to(DTYPES[dtype]) if dtype else model
        self.enc = get_tokenizer(model.config.vocab_size)
        self.window = model.config.block_size
        self._max_gen_toks = max_gen_toks
        self._device = model.lm_head.weight.device
        num_blocks = num_blocks or 16 * blocks_for(self.window, block_size)
        self.engine = scoring.scoring_engine(
            self.model,
            num_blocks=num_blocks,
            block_size=block_size,
            token_budget=token_budget,
            max_batch=max_batch,
            prefix_cache=prefix_cache,
            compile=compile,
            invariant=invariant,
            vocab_size=self.enc.n_vocab,  # HF's export has these ids; nanoGPT's padding never counts
        )

    # what lm-eval's TemplateLM asks of a model

    @property
    def eot_token_id(self):
        return self.enc.eot_token

    @property
    def max_length(self):
        return self.window

    @property
    def max_gen_toks(self):
        return self._max_gen_toks

    @property
    def tokenizer_name(self):
        return self.enc.name

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """GPT-2 adds no special tokens; an <|endoftext|> in the text is the token, as HF's tokenizer reads it."""
        return self.enc.encode(string, allowed_special="all")

    def tok_decode(self, tokens, **kwargs):
        return self.enc.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm=False):
        for r in requests:
            context, continuation = r.args
            if not continuation:  # lm-eval's own code fails on it with an IndexError
                raise ValueError(f"an empty continuation after context {context[-40:]!r}: there is nothing to score")
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: [((context, continuation) or None, context ids, continuation ids)] -> [(logprob, is_greedy)]."""
        pairs = [self.pair(context, continuation) for _, context, continuation in requests]
        results = self.score(pairs)
        for (key, _, _), result in zip(requests, results):
            if key is not None:  # rolling windows come without one: their texts are cached whole
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text's summed log-probability, every token scored once, in rolling windows of the model's window."""
        strings = [r.args[0] for r in requests]
        texts = [self.tok_encode(string) for string in strings]
        for tokens in texts:
            self.check_ids(tokens)
        windows = [scoring.rolling_windows(tokens, self.prefix_token_id, self.window) for tokens in texts]
        scores = self.score([pair for text in windows for pair in text])
        totals, i = [], 0
        for string, text in zip(strings, windows):
            totals.append(sum(logprob for logprob, _ in scores[i : i + len(text)]))
            i += len(text)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Each context's continuation, greedy or sampled as its generation kwargs say, cut at the first stop
        string (end-of-text is always one)."""
        runs = [self.generation(i, *r.args) for i, r in enumerate(requests)]
        for request, _ in runs:
            self.engine.check(request)  # refused before the engine takes any
        self.run_until(runs)
        texts = []
        for (request, until), (context, gen_kwargs) in zip(runs, (r.args for r in requests)):
            texts.append(postprocess_generated_text(self.enc.decode(request.generated), until, None))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), texts[-1])
        return texts

    # ours

    def check_ids(self, tokens):
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.enc.n_vocab:
            bad = next(t for t in tokens if not 0 <= t < self.enc.n_vocab)
            raise ValueError(f"id {bad} is outside the tokenizer's 0..{self.enc.n_vocab - 1}")

    def pair(self, context, continuation):
        """A (context, continuation) pair of ids as scoring.loglikelihood takes it, or a ValueError of one line."""
        if not continuation:
            raise ValueError(f"a continuation of no tokens after {len(context)} context tokens: nothing to score")
        if len(continuation) > self.window - 1:
            why = f"a continuation of {len(continuation)} tokens"
            raise ValueError(f"{why}: the model's window of {self.window} scores at most {self.window - 1} at once")
        self.check_ids(context)
        self.check_ids(continuation)
        return list(context) or [self.prefix_token_id], list(continuation)

    def score(self, pairs):
        """scoring.loglikelihood, once the engine would take every request: none is queued if one is refused."""
        for context, continuation in pairs:
            self.engine.check(scoring.scoring_request(self.engine, context, continuation))
        cut = sum(len(c) + len(x) > self.window for c, x in pairs)
        if cut:
            log.warning("%d of %d pairs exceed the window of %d tokens: their contexts are cut from the left",
                        cut, len(pairs), self.window)  # fmt: skip
        return scoring.loglikelihood(self.engine, pairs)

    def generation(self, index, context, gen_kwargs):
        """(the engine's Request for one generate_until request, its stop strings)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.enc.decode([self.eot_token_id]))
        max_gen_toks = kwargs.pop("max_gen_toks")
        do_sample = kwargs.pop("do_sample")
        unknown = set(kwargs) - set(SAMPLING)
        if unknown:
            why = f"generation kwargs {', '.join(sorted(unknown))}"
            raise ValueError(f"{why}: nanogpt-paged takes until, max_gen_toks, do_sample, {', '.join(SAMPLING)}")
        tokens = self.tok_encode(context) or [self.eot_token_id]
        self.check_ids(tokens)
        if len(tokens) > self.window:
            why = f"a context of {len(tokens)} tokens"
            raise ValueError(f"{why} leaves no room to generate in the model's window of {self.window}")
        if max_gen_toks < 1:
            raise ValueError(f"max_gen_toks {max_gen_toks} must be at least 1")
        top_k = kwargs.get("top_k")
        params = SamplingParams(
            temperature=float(kwargs.get("temperature", 0.0)) if do_sample else 0.0,
            top_k=top_k if top_k and top_k > 0 else None,  # 0 and -1: no cut, as HF's and vLLM's
            top_p=float(kwargs.get("top_p", 1.0)),
            min_p=float(kwargs.get("min_p", 0.0)),
            seed=int(kwargs.get("seed", 0)) + index,
            eos=self.eot_token_id,
        )
        max_new = min(max_gen_toks, self.window + 1 - len(tokens))  # the last new token is never fed back
        return Request(tokens, max_new, params), until

    def run_until(self, runs):
        """Run the requests at once; a sequence whose text shows one of its stop strings stops after its step."""
        engine = self.engine
        stops = {request: [s for s in until if s] for request, until in runs}
        for request, _ in runs:
            engine.add(request)
        while engine.waiting or engine.running:
            engine.step()
            for s in list(engine.running):
                r = s.request
                if s.status is SequenceStatus.DECODING and any(x in self.enc.decode(s.generated) for x in stops[r]):
                    engine.stop(s, SequenceStatus.DONE)  # as the engine stops one at eos, its blocks freed at once
                    engine.finish(r)
