"""The README's commands still parse: every `python generate.py ...` and `python bench/fork_memory.py ...` line
in its fenced code blocks goes through that script's own parse_args, without running anything, so that a
renamed or removed flag fails here before a reader meets it. The checks run in a temporary folder, where the
output folders parse_args makes (out/ ...) land instead of the repository."""

import os
import re
import shlex
from pathlib import Path

import pytest

import generate
from bench import fork_memory

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"generate.py": generate, "bench/fork_memory.py": fork_memory}
OUTPUTS = {"--json": "json", "--plot": "plot", "--pool-map": "pool_map", "--export-hf": "export_hf"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
RUNS_A_SCRIPT = re.compile(r"python\S*\s+(" + "|".join(re.escape(script) for script in SCRIPTS) + r")(\s|$)")


def words(line):
    """A shell line's words as the shell splits them: quotes removed, a `# comment` dropped, and `&&`, `;`
    and `|` as words of their own even without spaces around them."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def readme_commands(text):
    """Every command in text's fenced code blocks that runs one of SCRIPTS, as (script, argv): lines that end
    in a backslash joined to the next, a leading `$ ` prompt dropped, and each command of a `a && b` line
    on its own."""
    commands, fenced, line = [], False, ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced, line = not fenced, ""
            continue
        if not fenced:
            continue
        line += raw
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        line, command = "", line.strip().removeprefix("$ ")
        if not RUNS_A_SCRIPT.search(command):  # sample output and diagrams, whose quotes are no shell's
            continue
        segment = []
        for word in words(command) + [";"]:
            if word not in SEPARATORS:
                segment.append(word)
                continue
            if len(segment) >= 2 and os.path.basename(segment[0]).startswith("python") and segment[1] in SCRIPTS:
                commands.append((segment[1], segment[2:]))
            segment = []
    return commands


def short(script, argv, head=50, tail=30):
    """A test id: the command, its middle words left out where it is long (its end names its output file)."""
    parts = [script, *map(shlex.quote, argv)]
    text = " ".join(parts)
    if len(text) <= head + tail:
        return text
    first = last = 1
    while len(" ".join(parts[: first + 1])) <= head:
        first += 1
    while len(" ".join(parts[-last - 1 :])) <= tail:
        last += 1
    return f"{' '.join(parts[:first])} ... {' '.join(parts[-last:])}"


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


@pytest.fixture
def exact_flags(monkeypatch):
    """Both scripts' parsers with argparse's prefix matching off: otherwise a README flag that is now only the
    start of a renamed one (--pool-map, after a rename to --pool-map-file) would still parse."""
    for module in SCRIPTS.values():
        make = module.parser

        def exact(make=make):
            p = make()
            p.allow_abbrev = False
            return p

        monkeypatch.setattr(module, "parser", exact)


def parse(script, argv):
    """(None, the parsed flags) if the script's parse_args takes argv, else (its one-line error, None). It
    makes output folders: run it in a temporary folder."""
    try:
        return None, SCRIPTS[script].parse_args(argv)
    except SystemExit as e:
        return str(e.code), None


def test_the_readme_names_the_experiments():
    """Were the README's layout to change so that readme_commands found nothing, the test below would pass with
    no case: this one fails instead."""
    found = [script for script, _ in COMMANDS]
    assert found.count("generate.py") >= 8 and found.count("bench/fork_memory.py") >= 1, found


@pytest.mark.parametrize("script, argv", COMMANDS, ids=[short(*c) for c in COMMANDS])
def test_readme_command_parses_and_can_write_its_outputs(script, argv, tmp_path, monkeypatch, exact_flags):
    monkeypatch.chdir(tmp_path)  # out/... resolves here: parse_args makes output folders
    if "--prompts" in argv:  # parse_args does not read it, but the command names it: give it one prompt
        prompts = tmp_path / argv[argv.index("--prompts") + 1]
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text("ROMEO:\n", encoding="utf-8")
    error, args = parse(script, argv)
    assert error is None, f"the README's `{shlex.join([script, *argv])}` is refused: {error}"
    for flag, name in OUTPUTS.items():
        path = getattr(args, name, None)
        if not path:
            continue
        folder = (tmp_path / path).resolve().parent  # an absolute path stays itself
        assert folder.is_relative_to(tmp_path.resolve()), f"{flag} {path} writes outside the working folder"
        if flag == "--export-hf":  # export_hf makes DIR itself, when it runs; parse_args makes nothing
            os.makedirs(folder, exist_ok=True)
        assert folder.is_dir() and os.access(folder, os.W_OK), f"{flag} {path}: no writable folder {folder}"


def test_a_renamed_or_unknown_flag_in_a_readme_command_is_refused(tmp_path, monkeypatch, exact_flags):
    """The check above has teeth: README-like lines with stale flags are found, and each is refused."""
    monkeypatch.chdir(tmp_path)
    text = """Some text, and `python generate.py --not-in-a-block` inline, which is not a command.

```bash
$ python generate.py --compare --num-requests 128 \\
    --plot-file out/mixed.png      # --plot, renamed
python generate.py --paged --num-request 4          # a prefix of --num-requests: argparse would take it
pip install x && python bench/fork_memory.py --plots out/fork.png
python bench/fork_memory.py --plot out/fork.xyz
python bench/fork_memory.py --plot /dev/null/out/fork.png
```
"""
    commands = readme_commands(text)
    assert commands == [
        ("generate.py", ["--compare", "--num-requests", "128", "--plot-file", "out/mixed.png"]),
        ("generate.py", ["--paged", "--num-request", "4"]),
        ("bench/fork_memory.py", ["--plots", "out/fork.png"]),
        ("bench/fork_memory.py", ["--plot", "out/fork.xyz"]),
        ("bench/fork_memory.py", ["--plot", "/dev/null/out/fork.png"]),
    ]
    expected = [
        "error: unrecognized arguments: --plot-file out/mixed.png",
        "error: unrecognized arguments: --num-request 4",
        "error: unrecognized arguments: --plots out/fork.png",
        "error: --plot out/fork.xyz: the file name must end in one of .",
        "error: --plot /dev/null/out/fork.png: cannot make the folder /dev/null/out: Not a directory",
    ]
    for (script, argv), start in zip(commands, expected):
        error, _ = parse(script, argv)
        assert error is not None and error.startswith(start) and "\n" not in error, (argv, error)
    assert not (tmp_path / "out").exists(), "a refused command made its output folder"


def test_fork_memory_makes_its_plot_folder_before_the_run(tmp_path):
    path = tmp_path / "new" / "folder" / "fork.png"
    args = fork_memory.parse_args(["--plot", str(path), "--num-requests", "4", "--prompt-len", "8:32"])
    assert path.parent.is_dir() and not path.exists()
    assert (args.num_requests, args.prompt_len, args.new_tokens) == (4, (8, 32), (16, 128))
    error, _ = parse("bench/fork_memory.py", ["--num-requests", "0"])
    assert error == "error: argument --num-requests: 0 is below 1"
