"""lm-eval's own command line, with the paged engine's model registered as nanogpt-paged
(harness/lm_eval_model.py) and this repository's tasks/ folder included when no --include_path names another:

    python lm_eval_run.py --model nanogpt-paged --model_args ckpt=models/tiny-shakespeare.pt \\
        --tasks shakespeare_next_line --include_path tasks

Every flag is lm-eval's (`python lm_eval_run.py run --help`). Nothing is downloaded: Hugging Face's hub and
datasets are set offline unless the environment says otherwise, so a task or model that needs the network fails
instead. A bad model argument or request exits non-zero with one line."""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def main(argv=None):
    for name in OFFLINE:  # before lm-eval imports the hub's clients, which read them once
        os.environ.setdefault(name, "1")
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:  # not in requirements.txt: the tests' requirements bring it
        sys.exit(f"error: lm-eval is missing ({e}): pip install -r requirements-test.txt")

    import harness.lm_eval_model  # noqa: F401 (registers nanogpt-paged)

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv) and len(argv) > 1:
        argv += ["--include_path", os.path.join(ROOT, "tasks")]
    sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
