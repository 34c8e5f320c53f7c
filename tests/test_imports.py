"""The import graph of coder: layers point one way and nothing imports itself in a circle.

Every `import` / `from ... import` in coder/ counts, the ones inside functions included (a lazy
import is still a dependency). The layers, bottom to top:

    model, pallas, data  <  env  <  train  <  infer  <  rl  <  serve  <  stages

A library module never imports coder.stages (the entry points); coder.train imports none of
coder.rl, coder.env, coder.infer; and the graph of modules has no cycle.
"""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coder")


def _modules() -> dict[str, str]:
    """{dotted module name: file path} of every module under coder/."""
    out = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """coder modules that `path` imports (anywhere in the file)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from coder.x import y` depends on coder.x.y when y is a module, else on coder.x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("coder") and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_libraries_never_import_the_stages():
    bad = [(m, d) for m, deps in _graph().items() if not _in(m, "coder.stages")
           for d in deps if _in(d, "coder.stages")]
    assert not bad, f"library modules importing the stage layer: {bad}"


def test_train_imports_no_rl_env_or_infer():
    bad = [(m, d) for m, deps in _graph().items() if _in(m, "coder.train")
           for d in deps if any(_in(d, p) for p in ("coder.rl", "coder.env", "coder.infer"))]
    assert not bad, f"coder.train importing a layer above it: {bad}"


def test_layers_point_one_way():
    # model, pallas and data: independent libraries at the bottom (the model's attention may call
    # the NSA kernels); env (the sandbox, tools, scoring, tasks) above them, so data (tokenizers,
    # corpora) never reaches up into it
    layers = [("coder.model", "coder.pallas", "coder.data"), ("coder.env",), ("coder.train",),
              ("coder.infer",), ("coder.rl",), ("coder.serve",), ("coder.stages",)]
    level = {p: i for i, layer in enumerate(layers) for p in layer}

    def level_of(m):
        return next((i for p, i in level.items() if _in(m, p)), None)

    bad = []
    for m, deps in _graph().items():
        for d in deps:
            lm, ld = level_of(m), level_of(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append((m, d))
    assert not bad, f"imports pointing up the layers: {bad}"


def test_no_import_cycles():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: a function-level import is found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from coder.stages import lm\n    return lm\n")
    assert _imports(str(src), "coder.train.m", set(_modules())) == {"coder.stages.lm"}


def test_test_modules_import_no_test_module():
    """What several test modules share lives in support modules beside them (conftest fixtures,
    tests/serve/greeter.py, tests/infer/engine_inputs.py, ...), never in another test module:
    importing one runs its module-level code and collects nothing."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    offenders = []
    for directory, _, files in os.walk(tests_dir):
        for name in files:
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            path = os.path.join(directory, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                         and node.module and node.module.startswith("tests") else [])
                offenders += [f"{os.path.relpath(path, tests_dir)}: {n}" for n in names
                              if n.startswith("tests.") and any(p.startswith("test_") for p in n.split("."))]
    assert not offenders, offenders
