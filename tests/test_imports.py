"""How the repository's modules import each other: no circle anywhere, and a core that stands alone. The core is
the module that defines PagedEngine (scheduler.py) and every repository module it imports, at any depth: it
imports nothing of ext/, harness/ or bench/, and a plain `python generate.py --paged` steps through its files only,
while each flag that asks for an extension gets exactly that one, composed by ext.engine_class."""

import ast
import itertools
import sys
from pathlib import Path

import pytest

import generate
import scheduler
from ext.forks import PagedForks
from ext.speculative import Speculative
from ext.swap import Swap
from harness import experiments, serving

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["", "ext", "harness", "bench"]  # the repository's modules; tests/ imports them, never the other way
OUTSIDE_CORE = ("ext", "harness", "bench")


def repository_modules(root=ROOT):
    """Module name -> path, for every .py at the root and in ext/, harness/ and bench/; a package's __init__.py
    is its folder's name (bench/ has none: its scripts are bench.NAME, as the tests import them)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            parts = [folder] * bool(folder) + [path.stem] * (path.stem != "__init__")
            found[".".join(parts)] = path
    return found


def imported(name, dotted, modules):
    """The repository modules that importing `dotted` from module `name` runs: the module, and each package above
    it that `name` is not inside (a package's own modules import its siblings while it is being imported). A
    bench script's bare name that is no module at the root is a sibling in bench/ (the scripts run with bench/ on
    sys.path); a root module comes first, as each script puts the root first on sys.path."""
    if dotted not in modules and name.startswith("bench.") and f"bench.{dotted}" in modules:
        dotted = f"bench.{dotted}"
    parts = dotted.split(".")
    targets = []
    for i in range(1, len(parts) + 1):
        target = ".".join(parts[:i])
        inside = name == target or name.startswith(target + ".")
        if target in modules and (i == len(parts) or not inside):
            targets.append(target)
    return targets


def import_graph(root=ROOT):
    """Module -> {imported repository module: the line of its first import}. Every import statement counts, at
    any depth: one inside a function runs later, but a circle that it closes is still a circle."""
    modules = repository_modules(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                dotted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(filter(None, [*up, base]))
                # `from a import b`: b is a module of a's, or a name a defines
                dotted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for d in dotted:
                for target in imported(name, d, modules):
                    if target != name:
                        edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph):
    """A circle of imports, as the list of its modules with the first repeated at the end, or None."""
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def describe(graph, chain, root=ROOT):
    modules = repository_modules(root)
    return (
        " -> ".join(f"{a} ({modules[a].relative_to(root)}:{graph[a][b]})" for a, b in itertools.pairwise(chain))
        + f" -> {chain[-1]}"
    )


def core(graph, root=ROOT):
    """The module that defines PagedEngine, and every repository module it imports at any depth -> {module: the
    chain of imports that reaches it from the first}."""
    modules = repository_modules(root)
    defines = [
        name
        for name, path in modules.items()
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef) and node.name == "PagedEngine"
    ]
    assert defines == ["scheduler"], f"PagedEngine is defined in {defines}, not in scheduler.py alone"
    reached, todo = {"scheduler": ["scheduler"]}, ["scheduler"]
    while todo:
        module = todo.pop()
        for target in sorted(graph[module]):
            if target not in reached:
                reached[target] = reached[module] + [target]
                todo.append(target)
    return reached


def test_no_module_of_the_repository_imports_itself_through_others():
    graph = import_graph()
    assert {"scheduler", "ext", "ext.forks", "harness.serving", "bench.gpu", "generate"} <= set(graph)
    assert "ext" in graph["harness.serving"] and "scheduler" in graph["ext"]  # the graph sees the imports
    cycle = find_cycle(graph)
    assert cycle is None, f"an import circle: {describe(graph, cycle)}"


def test_find_cycle_finds_a_circle_and_only_a_circle():
    """The check above has teeth: a circle through three modules is found, with every step; a diamond is none."""
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1, "c": 1}, "b": {"d": 1}, "c": {"d": 1}, "d": {}}) is None


def test_the_graph_sees_lazy_relative_and_package_imports_and_bench_siblings(tmp_path):
    """The graph on a small repository of its own: an import inside a function, a relative import, a package's
    __init__ run by importing its module, a bench script's bare import of a sibling, and a root module before a
    bench one of the same name; the circles they close and the core's reach outside it are found."""
    files = {
        "scheduler.py": "class PagedEngine:\n    def f(self):\n        from harness.metrics import Meter\n",
        "sampling.py": "",
        "harness/__init__.py": "",
        "harness/metrics.py": "import scheduler\n",
        "ext/__init__.py": "from ext.forks import Forks\n",
        "ext/forks.py": "from . import swap\nfrom ext import ServingEngine\n",
        "ext/swap.py": "",
        "bench/a.py": "import os\nfrom b import x\n",
        "bench/b.py": "import sampling\nfrom ext.swap import Swap\n",
        "bench/sampling.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["scheduler"] == {"harness": 3, "harness.metrics": 3} and graph["harness.metrics"] == {"scheduler": 1}
    assert graph["ext"] == {"ext.forks": 1} and graph["ext.forks"] == {"ext.swap": 1, "ext": 2}
    assert graph["bench.a"] == {"bench.b": 2} and graph["bench.b"] == {"sampling": 1, "ext": 2, "ext.swap": 2}
    assert find_cycle(graph) == ["ext", "ext.forks", "ext"]
    assert (
        describe(graph, ["ext", "ext.forks", "ext"], tmp_path)
        == "ext (ext/__init__.py:1) -> ext.forks (ext/forks.py:2) -> ext"
    )
    assert core(graph, tmp_path) == {
        "scheduler": ["scheduler"],
        "harness": ["scheduler", "harness"],
        "harness.metrics": ["scheduler", "harness.metrics"],
    }


def test_the_core_imports_nothing_of_ext_harness_or_bench():
    graph = import_graph()
    reached = core(graph)
    outside = {m: chain for m, chain in reached.items() if m.split(".")[0] in OUTSIDE_CORE}
    assert not outside, "the core reaches " + "; ".join(describe(graph, chain) for chain in outside.values())
    assert {"engine", "paged", "model", "sequence"} <= set(reached), sorted(reached)


@pytest.fixture(scope="module")
def shipped():
    """The shipped model and its tokenizer, loaded and prepared as generate.py loads them."""
    return experiments.load_model(generate.parse_args(["--paged"]))


def build(flags, shipped):
    """The engine `python generate.py --paged FLAGS` serves its prompts with, built as generate.main builds it,
    and the requests it serves."""
    args = generate.parse_args(["--paged", *flags])
    args.eos = None  # generate.main's, without --stop-at-eos
    model, enc = shipped
    _, prompts, news = experiments.read_prompts(args, enc)
    [kind] = experiments.choose_designs(args)
    engine = serving.make_engine(model, kind, args, prompts, news, enc.n_vocab)
    return engine, serving.make_requests(args, prompts, news)


def test_a_plain_paged_run_is_the_bare_core_and_steps_through_its_files_only(shipped):
    """Every Python function the engine runs in a plain run, found by a profiler, is the core's, torch's or the
    standard library's. prepare(model), as generate.py calls it, swaps the model's largest linears for harness/
    tuning.py's PackedLinear and its GELUs for SmallGELU, the model's own modules: their forwards are the only
    functions outside the core it may run."""
    engine, requests = build([], shipped)
    assert type(engine) is scheduler.PagedEngine
    called = set()

    def profile(frame, event, arg):
        if event == "call":
            called.add(frame.f_code)

    sys.setprofile(profile)
    try:
        engine.run(requests)
    finally:
        sys.setprofile(None)
    assert all(len(r.generated) == r.max_new_tokens for r in requests)
    core_files = {repository_modules()[m] for m in core(import_graph())}
    ours = {(Path(c.co_filename), c.co_qualname) for c in called if Path(c.co_filename).is_relative_to(ROOT)}
    outside = {(str(f.relative_to(ROOT)), q) for f, q in ours if f not in core_files}
    prepared = {("harness/tuning.py", "PackedLinear.forward"), ("harness/tuning.py", "SmallGELU.forward")}
    assert outside <= prepared, sorted(outside)
    assert {"scheduler.py", "engine.py", "model.py", "paged.py"} <= {f.name for f, _ in ours}


@pytest.mark.parametrize(
    "flags, extension",
    [
        (["--num-samples", "2"], PagedForks),
        (["--preemption", "swap", "--swap-blocks", "4"], Swap),
        (["--num-speculative-tokens", "2"], Speculative),
    ],
    ids=["forks", "swap", "speculation"],
)
def test_a_flag_that_asks_for_an_extension_composes_that_one_alone(flags, extension, shipped):
    """ext.engine_class composes the extensions a run asks for, and no other: the engine's class is PagedEngine
    with classes of exactly `extension`'s file of ext/ in its ancestry."""
    import ext

    engine, _ = build(flags, shipped)
    asked = {PagedForks: "forks", Swap: "swap", Speculative: "speculative"}[extension]
    assert type(engine) is ext.engine_class(**{asked: True})
    files = {c.__module__ for c in type(engine).__mro__ if c.__module__.startswith("ext.")}  # Forks is PagedForks'
    assert files == {extension.__module__} and isinstance(engine, scheduler.PagedEngine), type(engine).__mro__
