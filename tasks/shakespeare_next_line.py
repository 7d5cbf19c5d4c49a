"""The data of the lm-eval task shakespeare_next_line (shakespeare_next_line.yaml beside this file): 200 questions
from the held-out plays, harness.scoring.multiple_choice(enc, 200, seed=0) with enc the shipped model's tokenizer
(GPT-2's BPE cut to 2,048 ids): a context of 64-192 of its tokens ending at a line's end, its true next line and
three verse lines from elsewhere, one JSON object a line: {"context", "choices", "label"}.

The file is committed (113 kB): the task is fixed whatever later changes the generator or the plays package, it
needs nothing of this repository to load, and nothing is written at run time. `python
tasks/shakespeare_next_line.py` writes it again; tests/test_scoring.py checks that it still equals the
generator's output."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "shakespeare_next_line.jsonl")
NUM_QUESTIONS, SEED, VOCAB_SIZE = 200, 0, 2048  # VOCAB_SIZE: the shipped model's, whose tokens the contexts count


def questions():
    """The task's rows as the generator makes them: [{"context", "choices", "label"}]."""
    sys.path.insert(0, os.path.dirname(HERE))
    from harness.checkpoints import get_tokenizer
    from harness.scoring import multiple_choice

    enc = get_tokenizer(VOCAB_SIZE)
    return [
        dict(context=context, choices=choices, label=label)
        for context, choices, label in multiple_choice(enc, NUM_QUESTIONS, SEED)
    ]


def rows(path=DATA):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load(**metadata):
    """lm-eval's custom_dataset: the committed file as a DatasetDict with one split, test. lm-eval passes the
    run's metadata (its model_args among them); the task needs none of it."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows())})


def main():
    with open(DATA, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in questions())
    print(f"wrote {NUM_QUESTIONS} questions to {os.path.relpath(DATA)}")


if __name__ == "__main__":
    main()
