"""The README's commands work with the code as it is. Every `python generate.py ...` and `python bench/NAME.py ...`
command it gives, in a code block or inline, goes through that script's own argument parsing (no prefix matching)
without running anything, so that a renamed or removed flag fails here before a reader meets it; the first-run
command runs as the README gives it, and prints what the README shows of its output; the test command is the one
CI runs, and collects this suite. Commands are found by what they run, not by the prose around them. The checks run
in a temporary folder, where the output folders parsing makes (out/ ...) land instead of the repository."""

import argparse
import importlib
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import generate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = r"(generate\.py|bench/\w+\.py)"
RUNS_A_SCRIPT = re.compile(r"python\S*\s+" + SCRIPT + r"(\s|$)")
OUTPUTS = {"--json": "json", "--plot": "plot", "--pool-map": "pool_map", "--export-hf": "export_hf", "--out": "out"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def words(line):
    """A shell line's words as the shell splits them: quotes removed, a `# comment` dropped, and `&&`, `;`
    and `|` as words of their own even without spaces around them."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def fenced_lines(text):
    """Each shell line of text's fenced code blocks, as (block number, line): lines that end in a backslash joined
    to the next, a leading `$ ` prompt dropped."""
    lines, block, fenced, line = [], -1, False, ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced, line = not fenced, ""
            block += fenced
            continue
        if not fenced:
            continue
        line += raw
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        lines.append((block, line.strip().removeprefix("$ ")))
        line = ""
    return lines


def inline_spans(text):
    """The `code spans` of text outside its fenced blocks, a span's line breaks as spaces."""
    outside = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [span.replace("\n", " ").strip() for span in re.findall(r"`([^`]+)`", outside)]


def shell_commands(line):
    """A shell line's commands, each as its words: `a && b; c | d` gives four. A line the shell could not split (a
    code block's sample output) gives none: a script's command lost so is caught by the first test below."""
    try:
        split = words(line)
    except ValueError:  # an unclosed quote
        return []
    commands, segment = [], []
    for word in split + [";"]:
        if word not in SEPARATORS:
            segment.append(word)
        elif segment:
            commands.append(segment)
            segment = []
    return commands


def commands_of(line):
    """Each `python ARGS` command of a shell line, as its words, after any `NAME=value` the shell would put in its
    environment (`LD_PRELOAD=... python generate.py`)."""
    commands = [list(itertools.dropwhile(lambda w: re.fullmatch(r"\w+=\S*", w), c)) for c in shell_commands(line)]
    return [c for c in commands if c and os.path.basename(c[0]).startswith("python")]


def readme_commands(text, inline=False):
    """Every command in text's fenced code blocks (and with inline=True, its code spans) that runs generate.py or a
    script in bench/, as (script, argv). A span with a `...` word is an elision, not a command, and is left out;
    lines that name no script (sample output, diagrams: their quotes are no shell's) are never split."""
    lines = [line for _, line in fenced_lines(text)]
    if inline:
        lines += [span for span in inline_spans(text) if "..." not in span.split()]
    found = []
    for line in lines:
        if RUNS_A_SCRIPT.search(line):
            found += [(c[1], c[2:]) for c in commands_of(line) if len(c) > 1 and re.fullmatch(SCRIPT, c[1])]
    return found


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


README = (ROOT / "README.md").read_text(encoding="utf-8")
# each once: the README gives some twice (`python generate.py --paged`, `python bench/gpu.py`)
COMMANDS = [
    (script, list(argv)) for script, argv in dict.fromkeys((s, tuple(a)) for s, a in readme_commands(README, True))
]


class Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


PARSE_ARGS, PARSE_KNOWN_ARGS = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args


@pytest.fixture
def exact_flags(monkeypatch):
    """Every parser with argparse's prefix matching off (otherwise a README flag that is now only the start of a
    renamed one, --pool-map after a rename to --pool-map-file, would still parse), and its errors in one line."""

    def exact(self, args=None, namespace=None):
        self.allow_abbrev = False
        return PARSE_KNOWN_ARGS(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", exact)
    monkeypatch.setattr(argparse.ArgumentParser, "error", lambda self, message: sys.exit(f"error: {message}"))


def script_module(script, monkeypatch):
    """generate, or bench/NAME.py imported as bench.NAME (bench/ last on sys.path, for its scripts' imports of each
    other by bare name)."""
    if script == "generate.py":
        return generate
    monkeypatch.syspath_prepend(str(ROOT))  # as each script puts the repository first
    monkeypatch.setattr(sys, "path", [*sys.path, str(ROOT / "bench")])
    return importlib.import_module("bench." + Path(script).stem)


def parse(script, argv, monkeypatch):
    """(None, the parsed flags) if the script takes argv, else (its one-line error, None); (None, None) for --help.
    A script's own parse_args checks its flags together; a script whose main() builds its parser runs main() until
    its parser has parsed, and stops there. It makes output folders: run it in a temporary folder."""
    module = script_module(script, monkeypatch)
    try:
        if hasattr(module, "parse_args"):
            return None, module.parse_args(argv)
        if hasattr(module, "parser"):
            return None, module.parser().parse_args(argv)
        with monkeypatch.context() as m:
            m.setattr(sys, "argv", [script, *argv])

            def parsed(self, args=None, namespace=None):
                raise Parsed(PARSE_ARGS(self, args, namespace))

            m.setattr(argparse.ArgumentParser, "parse_args", parsed)
            module.main()
        raise AssertionError(f"{script}'s main() returned without parsing its arguments")
    except Parsed as p:
        return None, p.namespace
    except SystemExit as e:
        return (None if e.code in (0, None) else str(e.code)), None


def test_every_line_that_runs_a_script_gives_its_commands():
    """Each code-block line and inline span that runs generate.py or a bench script gives at least one command to
    the test below: a README laid out so that a command is missed fails here, instead of a test with fewer cases."""
    lines = [line for _, line in fenced_lines(README)] + [s for s in inline_spans(README) if "..." not in s.split()]
    missed = [line for line in lines if RUNS_A_SCRIPT.search(line) and not readme_commands(f"```\n{line}\n```")]
    assert not missed, missed
    assert {script for script, _ in COMMANDS} >= {"generate.py"}, "the README gives no generate.py command"


@pytest.mark.parametrize("script, argv", COMMANDS, ids=[short(*c) for c in COMMANDS])
def test_readme_command_parses_and_can_write_its_outputs(script, argv, tmp_path, monkeypatch, exact_flags):
    monkeypatch.chdir(tmp_path)  # out/... resolves here: parsing makes output folders
    if "--prompts" in argv:  # parse_args does not read it, but the command names it: give it one prompt
        prompts = tmp_path / argv[argv.index("--prompts") + 1]
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text("ROMEO:\n", encoding="utf-8")
    error, args = parse(script, argv, monkeypatch)
    assert error is None, f"the README's `{shlex.join([script, *argv])}` is refused: {error}"
    for flag, name in OUTPUTS.items():
        path = getattr(args, name, None) if flag in argv else None
        if not path:
            continue
        folder = (tmp_path / path).resolve().parent  # an absolute path stays itself
        assert folder.is_relative_to(tmp_path.resolve()), f"{flag} {path} writes outside the working folder"
        os.makedirs(folder, exist_ok=True)  # a script that makes it when it runs (export_hf, bench/gpu.py's --out)
        assert folder.is_dir() and os.access(folder, os.W_OK), f"{flag} {path}: no writable folder {folder}"


def test_the_install_steps_name_files_that_exist_and_end_in_the_first_run(tmp_path, monkeypatch, capsys):
    """The README's first code block that installs with pip: every `-r FILE` it installs is in the repository, and
    its last command is the first run, `python generate.py ...`. That command runs here exactly as given, and each
    `--- ` line the README shows of its output (the next code block that holds such lines) starts a line of what it
    printed, up to its timing (` in `: seconds and speed differ by machine)."""
    blocks = {}
    for block, line in fenced_lines(README):
        blocks.setdefault(block, []).append(line)
    installs = [
        b for b, lines in blocks.items() if any(c[:2] == ["pip", "install"] for x in lines for c in shell_commands(x))
    ]
    assert installs, "the README gives no `pip install` in a code block"
    lines = blocks[installs[0]]
    for c in (c for line in lines for c in shell_commands(line) if c[:2] == ["pip", "install"]):
        for flag, value in itertools.pairwise(c):
            if flag in ("-r", "--requirement"):
                assert (ROOT / value).is_file(), f"the README installs `-r {value}`, which is not in the repository"
    first_run = [c for c in commands_of(lines[-1]) if c[1:2] == ["generate.py"]]
    assert first_run, f"the install block ends in `{lines[-1]}`, not a `python generate.py` command"
    monkeypatch.chdir(tmp_path)
    generate.main(first_run[-1][2:])
    printed = capsys.readouterr().out.splitlines()
    assert printed, "the first run printed nothing"
    outputs = [[x for x in lines if x.startswith("--- ")] for b, lines in blocks.items() if b > installs[0]]
    for line in next((shown for shown in outputs if shown), []):
        head = line.split(" in ")[0]
        tail = "\n".join(p for p in printed if p.startswith("--- "))
        assert any(p.startswith(head) for p in printed), (
            f"the README shows `{line}`; the first run printed, of its `--- ` lines:\n{tail}"
        )


def test_the_readme_test_command_is_what_ci_runs_and_collects_this_suite():
    """The last command of .ci/run (python3 there, python here) is a `python -m pytest ...` command of the README's
    code blocks, and run from the repository's root it collects this file's tests."""
    found = [c[1:] for _, line in fenced_lines(README) for c in commands_of(line) if c[1:3] == ["-m", "pytest"]]
    ci = [words(line) for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in words(line)[2:3]]
    assert ci, ".ci/run runs no `python3 -m pytest`"
    command = ci[-1]
    assert command[1:] in found, f"CI runs `{shlex.join(command)}`; the README's pytest commands: {found}"
    run = subprocess.run(
        [sys.executable, *command[1:], "--collect-only", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (
        f"tests/{Path(__file__).name}::test_the_readme_test_command_is_what_ci_runs_and_collects_this_suite"
        in run.stdout
    )


def test_a_renamed_or_unknown_flag_in_a_readme_command_is_refused(tmp_path, monkeypatch, exact_flags):
    """The check above has teeth: README-like lines with stale flags are found, in code blocks and code spans, and
    each is refused, by generate.py, by a bench script's parse_args and by one whose main() builds its parser."""
    monkeypatch.chdir(tmp_path)
    text = """Some text, and `python generate.py --paged --num-request 4 ...` inline, an elision, which is not a command;
`python bench/speculation.py --k 4` is one, and so is `python
bench/gpu.py --section tests`, broken over two lines.

```bash
$ python generate.py --compare --num-requests 128 \\
    --plot-file out/mixed.png      # --plot, renamed
python generate.py --paged --num-request 4          # a prefix of --num-requests: argparse would take it
pip install x && python bench/fork_memory.py --plots out/fork.png
python bench/fork_memory.py --plot out/fork.xyz
python bench/fork_memory.py --plot /dev/null/out/fork.png
```
"""
    commands = readme_commands(text, inline=True)
    assert commands == [
        ("generate.py", ["--compare", "--num-requests", "128", "--plot-file", "out/mixed.png"]),
        ("generate.py", ["--paged", "--num-request", "4"]),
        ("bench/fork_memory.py", ["--plots", "out/fork.png"]),
        ("bench/fork_memory.py", ["--plot", "out/fork.xyz"]),
        ("bench/fork_memory.py", ["--plot", "/dev/null/out/fork.png"]),
        ("bench/speculation.py", ["--k", "4"]),
        ("bench/gpu.py", ["--section", "tests"]),
    ]
    expected = [
        "error: unrecognized arguments: --plot-file out/mixed.png",
        "error: unrecognized arguments: --num-request 4",
        "error: unrecognized arguments: --plots out/fork.png",
        "error: --plot out/fork.xyz: the file name must end in one of .",
        "error: --plot /dev/null/out/fork.png: cannot make the folder /dev/null/out: Not a directory",
        "error: unrecognized arguments: --k 4",
        "error: unrecognized arguments: --section tests",
    ]
    for (script, argv), start in zip(commands, expected):
        error, _ = parse(script, argv, monkeypatch)
        assert error is not None and error.startswith(start) and "\n" not in error, (argv, error)
    assert not (tmp_path / "out").exists(), "a refused command made its output folder"
    assert readme_commands(text) == commands[:5], "without inline=True, only the code blocks' commands"


def test_fork_memory_makes_its_plot_folder_before_the_run(tmp_path, monkeypatch):
    from bench import fork_memory

    path = tmp_path / "new" / "folder" / "fork.png"
    args = fork_memory.parse_args(["--plot", str(path), "--num-requests", "4", "--prompt-len", "8:32"])
    assert path.parent.is_dir() and not path.exists()
    assert (args.num_requests, args.prompt_len, args.new_tokens) == (4, (8, 32), (16, 128))
    error, _ = parse("bench/fork_memory.py", ["--num-requests", "0"], monkeypatch)
    assert error == "error: argument --num-requests: 0 is below 1"
