"""The code's shape: imports go one way, down jaxdp's layers, and the jax side stands without
the torch side; what starts before jax imports none of it, and an import inside a function says why.

The module graph is read from the source with ``ast`` (every import statement, those inside
functions too, and the ``jaxdp`` package's lazy exports), so a cycle, an import up a layer or a
torch import that only runs on some path is still found.
"""

import ast
import graphlib
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
import tomllib
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdp", "parity_tests", "torch_ref", "torch_commands")
TORCH_SIDE = ("torch", "torch_ref", "parity_tests", "torch_commands")

# jaxdp's layers, lowest first (docs/architecture.md). A module imports from its own folder and
# from the layers below its own, never from a layer above nor from another folder of its layer.
# "jaxdp" is the package itself: its public names, loaded lazily from api/, loss/ and runtime/.
LAYERS = (
    ("names",),  # the name tables: models by family, optimizers, schedules, datasets, ... (imports nothing)
    ("runtime", "data", "loss"),  # devices and meshes (the mesh degrees); numpy data; the loss contract
    ("registry",),  # strategy names, each with whether its mesh has a replica degree (read from runtime's)
    ("config", "optim", "parallel", "checkpoint"),  # the options tree; optimizers; model axes; the checkpoint service
    ("models",),  # model families, with their tensor-parallel plans
    ("strategies", "interop"),  # the strategies over one TrainState; torch state_dict <-> Flax
    ("analysis",),  # inspect's and plan's measurements
    ("api",),  # the Trainer, save/restore, input checks (trainer.inspect: analysis's)
    ("jaxdp",),  # the package's public names
    ("run",),  # jaxdp train's loop, driving a Trainer
    ("cli",),  # the jaxdp command
)


def modules(root: Path = ROOT) -> dict:
    """{dotted module name: path} for every module of PACKAGES (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


class Import(NamedTuple):
    """One import statement: its first and last line, the names it imports (absolute; ``from a
    import b`` gives ``a.b``, b a module or a name in ``a``) and whether it runs in a function."""
    line: int
    end: int
    names: frozenset
    in_function: bool


def import_statements(name: str, source: str, is_package: bool = False) -> list:
    """Every import statement of module ``name`` (a package's ``__init__`` if ``is_package``)."""
    package = name if is_package else name.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = {alias.name for alias in child.names}
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, one level up per extra dot
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                names = {f"{base}.{alias.name}" for alias in child.names}
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                continue
            found.append(Import(child.lineno, child.end_lineno, frozenset(names), in_function))

    visit(ast.parse(source), False)
    return found


def imported_names(name: str, path: Path) -> set:
    """Every module name ``name`` imports, at any level."""
    return set().union(*(s.names for s in import_statements(name, path.read_text(), path.name == "__init__.py")))


def resolver(found: dict) -> Callable:
    """A dotted name -> the longest module of the project it names (None: not the project's)."""
    def resolve(dotted: str):
        while dotted and dotted not in found:
            dotted = dotted.rpartition(".")[0]
        return dotted or None
    return resolve


def import_graph(root: Path = ROOT) -> dict:
    """{module: the project modules it imports}: each imported name resolved to the longest
    module of the project it names."""
    found = modules(root)
    resolve = resolver(found)
    graph = {}
    for name, path in found.items():
        targets = {resolve(n) for n in imported_names(name, path)}
        graph[name] = targets - {None, name}
    graph["jaxdp"] |= {f"jaxdp.{module}" for module in lazy_exports(root).values()}
    return graph


def lazy_exports(root: Path = ROOT) -> dict:
    """``jaxdp``'s ``_EXPORTS`` ({public name: module under jaxdp}), read from the source."""
    tree = ast.parse((root / "jaxdp" / "__init__.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets))


def layer_of(module: str) -> int:
    """The index in LAYERS of a jaxdp module's folder (``jaxdp.strategies.zero`` -> strategies')."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else "jaxdp"
    return next(i for i, layer in enumerate(LAYERS) if folder in layer)


def folder_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports_against_the_layers(graph: dict) -> list:
    """Every import within jaxdp that goes up a layer or across to another folder of its layer."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.split(".")[0] == "jaxdp"
                  for b in targets if b.split(".")[0] == "jaxdp" and folder_of(a) != folder_of(b)
                  and layer_of(b) >= layer_of(a))


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_reads_function_level_and_relative_imports():
    """The reader itself: an import inside a function (the CLI's train command), relative ones (the
    data package), and a circle as the data package once had one (synthetic imported datasets)."""
    graph = import_graph()
    assert "jaxdp.data.arrays" in graph["jaxdp.data.synthetic"]  # `from .arrays import ArrayDataset`
    assert {"jaxdp.data.synthetic", "jaxdp.data.cifar10"} <= graph["jaxdp.data.datasets"]  # `from . import cifar10`
    assert "jaxdp.run.train" in graph["jaxdp.cli.command"]  # inside cmd_train
    assert "jaxdp.models.errors" in graph["jaxdp.models.batchnorm"]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({**graph, "jaxdp.data.arrays": {"jaxdp.data.datasets"}}).prepare()


def test_the_jaxdp_root_holds_packages_and_three_one_idea_modules():
    """Folders by concern (docs/architecture.md): a new module goes into the package of its concern,
    and every folder has its place in the layers. (The root's: the optimizers and the two jax-free
    name tables; the weight conversion is the package interop/.)"""
    root = sorted(p.stem for p in (ROOT / "jaxdp").glob("*.py"))
    assert root == ["__init__", "names", "optim", "registry"]
    packages = sorted(p.parent.name for p in (ROOT / "jaxdp").glob("*/__init__.py"))
    assert packages == ["analysis", "api", "checkpoint", "cli", "config", "data", "interop", "loss", "models",
                        "parallel", "run", "runtime", "strategies"]
    placed = [folder for layer in LAYERS for folder in layer]
    members = [*packages, *(name for name in root if name != "__init__"), "jaxdp"]
    assert sorted(placed) == sorted(members), "place each folder and root module in LAYERS, once"


def test_no_import_cycles():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail("import cycle: " + " -> ".join(e.args[1]))


def test_imports_only_look_down_the_layers():
    """The Trainer sits above the strategies and the loss contract below them; the checkpoint
    service below the Trainer and jaxdp train; the CLI on top (LAYERS)."""
    graph = import_graph()
    assert {"jaxdp.api.trainer", "jaxdp.loss.reductions"} <= graph["jaxdp"]  # the lazy exports count
    assert imports_against_the_layers(graph) == []


def test_the_layer_check_finds_an_import_up_or_across():
    """The check itself: imports as they stood before the layers (api's save path reaching run/,
    plan's command reaching the CLI from analysis/, a strategy reaching the Trainer) are found, and
    so is one between two folders of one layer."""
    graph = import_graph()
    wrong = {"jaxdp.api.trainer": {"jaxdp.run.rundir"}, "jaxdp.analysis.plan": {"jaxdp.cli.commands"},
             "jaxdp.strategies.base": {"jaxdp.api.trainer"}, "jaxdp.analysis.measure": {"jaxdp.api.trainer"}}
    found = imports_against_the_layers({**graph, **{a: graph[a] | b for a, b in wrong.items()}})
    assert found == sorted(f"{a} -> {b}" for a, targets in wrong.items() for b in targets)


def test_the_jax_side_imports_nothing_of_the_torch_side():
    """jaxdp/ never imports torch, torch_ref or parity_tests, at any level: `pip install jaxdp`
    has none of them. (parity and bench reach jaxdp's CLI as entry points, jaxdp.cli.commands.)"""
    found = modules()
    offenders = {name: sorted(n for n in imported_names(name, path) if n.split(".")[0] in TORCH_SIDE)
                 for name, path in found.items() if name.split(".")[0] == "jaxdp"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_inspect_bench_and_parity_never_reach_a_trainer():
    """They use the library (strategies, models, analysis), never jaxdp.run.train or torch_ref.train.
    ``python -m parity_tests`` is ``jaxdp parity`` (the CLI): not counted; nor are the tests."""
    graph = import_graph()
    users = [m for m in graph if m.startswith(("jaxdp.analysis", "parity_tests", "torch_commands"))
             and not m.rpartition(".")[2].startswith(("test_", "__main__"))]
    assert "torch_commands.bench.command" in users and "parity_tests.runner" in users
    reached = {m: sorted(reachable(graph, m) & {"jaxdp.run.train", "torch_ref.train", "jaxdp.cli.command"}) for m in users}
    assert {m: r for m, r in reached.items() if r} == {}


# ----------------------------------------------------------------------------- imports in functions

# What starts without jax, flax, optax and orbax (JAX_SIDE), and why (docs/architecture.md, "Imports").
# No module these import at module level, nor any module that one imports, imports JAX_SIDE at
# module level; a function of such a module may import JAX_SIDE, and the project modules that import
# it, where it needs it (this list is that import's reason). jax reads XLA_FLAGS when it creates its
# backend, not when it is imported, so what these buy is their start-up and a torch process without jax.
JAX_FREE = {
    "jaxdp": "`import jaxdp` imports no jax (its names load on first use): a script sets XLA_FLAGS after it",
    "jaxdp.cli.command": "the parser: `jaxdp train --help` takes ~0.15 s, jax, flax and optax ~0.75 s more "
                         "(and `jaxdp plan` sets $JAX_PLATFORMS, which jax reads when it is imported)",
    "parity_tests.command": "a registered command: `jaxdp --help` builds its parser too",
    "torch_commands.bench.command": "a registered command",
    "torch_commands.export": "a registered command",
    "torch_commands.gpu_check.command": "gpu-check sets $JAX_PLATFORMS and XLA's flags before jax starts",
    "torch_ref.train": "the torch ranks start without jax (torch_ref's docstring)",
    "torch_ref.step_api": "the parity harness's torch ranks",
    "jaxdp.data": "numpy only: jaxdp and torch_ref read the same batches (docs/design-notes.md)",
}
JAX_SIDE = ("jax", "jaxlib", "flax", "optax", "orbax")
# Optional dependencies, imported only where they are used, so that jaxdp runs without them.
OPTIONAL = {"tensorboardX": "the [tensorboard] extra", "sklearn": "the [digits] extra",
            "yaml": "PyYAML, for a .yaml config file", "matplotlib": "the [torch] extra, for inspect's --plot"}
EXPLAINED = ("jaxdp",)  # the packages whose every function-level import says why


def packages_of(module: str) -> list:
    """The packages Python imports before ``module``: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_level_graph(root: Path = ROOT) -> dict:
    """{module: what importing it imports}: the project modules its module-level imports name, the
    packages that hold them and its own, and other packages by their top-level name (``jax``)."""
    found = modules(root)
    resolve = resolver(found)
    graph = {}
    for name, path in found.items():
        statements = import_statements(name, path.read_text(), path.name == "__init__.py")
        targets = {resolve(n) or n.split(".")[0] for s in statements if not s.in_function for n in s.names}
        targets |= {p for t in targets | {name} for p in packages_of(t) if p in found}
        graph[name] = targets - {name}
    return graph


def imported_with(graph: dict, module: str) -> set:
    return {module} | reachable(graph, module)


def jax_at_import(graph: dict, roots) -> dict:
    """{module: the JAX_SIDE packages it imports at module level} among what ``roots`` import."""
    loaded = set().union(*(imported_with(graph, r) for r in roots))
    found = {m: sorted(graph.get(m, set()) & set(JAX_SIDE)) for m in loaded}
    return {m: side for m, side in found.items() if side}


def unexplained_imports(name: str, source: str, jax_free: bool, jax_side: Callable[[str], bool],
                        is_package: bool = False) -> list:
    """Module ``name``'s function-level imports that give no reason, as 'line: text'. A reason is: an
    optional dependency (OPTIONAL); in a module that must import without jax (``jax_free``), JAX_SIDE or
    a module that imports it (``jax_side(name)``); or a comment on the statement's lines or on a line
    of its own just above the block of imports the statement is in."""
    lines = source.splitlines()
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT and not token.string.startswith("# noqa")}
    statements = import_statements(name, source, is_package)
    import_lines = {n for s in statements for n in range(s.line, s.end + 1)}
    found = []
    for s in statements:
        if not s.in_function or all(n.split(".")[0] in OPTIONAL for n in s.names):
            continue
        if jax_free and all(jax_side(n) for n in s.names):
            continue
        above = s.line - 1
        while above in import_lines:  # up to the first statement of its block
            above -= 1
        said_above = above in comments and lines[above - 1].lstrip().startswith("#")
        if not (said_above or comments & set(range(s.line, s.end + 1))):
            found.append(f"{s.line}: {lines[s.line - 1].strip()}")
    return found


def function_level_imports_without_a_reason(root: Path = ROOT) -> dict:
    """{module: its unexplained imports} over the EXPLAINED packages."""
    graph, found = module_level_graph(root), modules(root)
    resolve = resolver(found)
    jax_free = set().union(*(imported_with(graph, r) for r in JAX_FREE))

    def jax_side(dotted: str) -> bool:
        module = resolve(dotted)
        return bool(imported_with(graph, module) & set(JAX_SIDE)) if module else dotted.split(".")[0] in JAX_SIDE

    unexplained = {name: unexplained_imports(name, path.read_text(), name in jax_free, jax_side,
                                             path.name == "__init__.py")
                   for name, path in found.items() if name.split(".")[0] in EXPLAINED}
    return {name: lines for name, lines in unexplained.items() if lines}


def test_what_starts_before_jax_imports_none_of_it():
    """The parser, `import jaxdp`, the torch ranks and the data package (JAX_FREE) reach no jax, flax,
    optax or orbax at module level, through any module they import."""
    graph = module_level_graph()
    assert {"jaxdp.cli.command", "jaxdp.runtime.mesh", "jaxdp.run.perf", "torch_commands.bench.runner",
            "jaxdp.run.rundir"} <= set().union(*(imported_with(graph, r) for r in JAX_FREE))
    assert "jaxdp.analysis.measure" not in imported_with(graph, "jaxdp.cli.command")  # inspect's run imports it
    assert jax_at_import(graph, JAX_FREE) == {}


def test_the_check_before_jax_finds_a_module_level_jax_import():
    graph = module_level_graph()
    planted = {**graph, "jaxdp.config.fields": graph["jaxdp.config.fields"] | {"optax"}}
    assert jax_at_import(planted, JAX_FREE) == {"jaxdp.config.fields": ["optax"]}
    assert jax_at_import(graph, ["jaxdp.analysis.measure"])  # a module after jax: at its top


def test_every_function_level_import_says_why():
    """An import sits in a function only for a reason, and says which: jax's side in a module that
    must start without it (JAX_FREE), an optional dependency (OPTIONAL), or a comment (e.g. `not for
    --help: ...`). Everything else is imported at the top of its module."""
    assert function_level_imports_without_a_reason() == {}


def test_the_function_level_check_finds_an_import_without_a_reason(tmp_path):
    def heavy(dotted):
        return dotted.split(".")[0] == "jax" or dotted.startswith("jaxdp.models")

    source = textwrap.dedent("""
        def loop():
            import jax
            from jaxdp.config import choices
            import tensorboardX
            from jaxdp.models import create_model  # the reason
            # the reason for the block below
            import optax
            from jaxdp.names import DATASETS
            from jaxdp.run import rundir
            x = 1  # a comment on another line is no reason
            import numpy

        import jax
    """)
    after_jax = ["3: import jax", "4: from jaxdp.config import choices", "12: import numpy"]
    assert unexplained_imports("jaxdp.run.loop", source, jax_free=False, jax_side=heavy) == after_jax
    before_jax = ["4: from jaxdp.config import choices", "12: import numpy"]
    assert unexplained_imports("jaxdp.run.loop", source, jax_free=True, jax_side=heavy) == before_jax

    # the whole check, on a copy of the code with two imports planted
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    lines = {}
    for module, planted in (("run/train.py", "import optax"), ("runtime/mesh.py", "from jaxdp.runtime import startup")):
        path = tmp_path / "jaxdp" / module
        text = path.read_text() + "\n\ndef planted():\n    import jax\n    " + planted + "\n"
        path.write_text(text)
        lines[module] = len(text.splitlines())
    # train imports jax at its top (no reason to wait); mesh must import without jax (it may wait), but
    # not for a jax-free module
    assert function_level_imports_without_a_reason(tmp_path) == {
        "jaxdp.run.train": [f"{lines['run/train.py'] - 1}: import jax", f"{lines['run/train.py']}: import optax"],
        "jaxdp.runtime.mesh": [f"{lines['runtime/mesh.py']}: from jaxdp.runtime import startup"]}


def test_a_plain_install_brings_only_the_jax_side():
    """`pip install jaxdp`: no torch, no matplotlib; `jaxdp[torch]` (or [parity]) adds them and the
    commands that need them; `.[dev]` has everything `make test` and `make train` use."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]

    def names(requirements):
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    extras = project["optional-dependencies"]
    assert not names(project["dependencies"]) & {"torch", "matplotlib"}
    assert {"torch", "matplotlib"} <= names(extras["torch"])
    assert "jaxdp[torch]" in extras["parity"] and "jaxdp[torch]" in extras["dev"]
    commands = project["entry-points"]["jaxdp.commands"]
    assert commands == {"parity": "parity_tests.command:PARITY", "bench": "torch_commands.bench.command:BENCH",
                        "export": "torch_commands.export:EXPORT"}
    from jaxdp.cli.command import BUILT_IN
    from jaxdp.cli.commands import registered

    assert not set(BUILT_IN) & set(commands)  # jaxdp's own commands are listed in the CLI, not by entry point
    assert set(registered(skip=BUILT_IN)) == set(commands), \
        "stale install metadata: run pip install -e '.[dev]' (make install)"


# Run with torch unimportable (as after `pip install jaxdp`): the training path works, pulls in
# nothing of the torch side, and the [torch] commands say what to install.
_WITHOUT_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # `import torch` raises ImportError, as when it is not installed

    import jaxdp, jaxdp.cli.command, jaxdp.strategies, jaxdp.api.trainer
    import jax, numpy as np, optax
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer

    try:
        jaxdp.cli.command.main(["train", "--help"])
    except SystemExit as e:
        assert e.code == 0, e.code
    model = create_model("resnet18", width=4, blocks=(1, 1, 1, 1))
    trainer = jaxdp.Trainer(model, jaxdp.classifier(model), make_optimizer("sgd", 0.1),
                            jaxdp.ZeRO(stage=3), jaxdp.make_mesh(data=2))
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(4, 8, 8, 3)).astype(np.float32), "label": np.arange(4, dtype=np.int32)}
    state = trainer.init(jax.random.key(0), batch)
    start = trainer.canonical(state)  # the full params and BN statistics the step starts from
    state, metrics = trainer.step(state, batch)

    def device_loss(rows):  # ZeRO-3 like DDP: each device's BN sees its own 2 images
        variables = {"params": start.params, **start.model_state}
        logits, _ = model.apply(variables, batch["image"][rows], train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"][rows]).mean()

    print("loss", float(metrics["loss"]), float((device_loss(slice(0, 2)) + device_loss(slice(2, 4))) / 2))
    print("torch side", sorted(m for m in sys.modules if m.split(".")[0] in ("torch_ref", "parity_tests", "matplotlib")
                               or (m.startswith("torch") and sys.modules[m] is not None)))
    for command, args in (("parity", ["--devices", "2"]), ("bench", ["--devices", "2"]), ("export", ["--torch", "a", "b"])):
        print(command, jaxdp.cli.command.main([command, *args]))
""")


def test_training_without_torch_and_the_torch_commands_say_what_to_install():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    loss, reference = map(float, next(line for line in out if line.startswith("loss ")).split()[1:])
    assert abs(loss - reference) < 1e-5 * reference, (loss, reference)  # the step ran, on the right numbers
    assert "torch side []" in out
    assert "parity 2" in out and "bench 2" in out and "export 2" in out
    hints = [line for line in done.stderr.splitlines() if line.startswith("jaxdp: error: ")]
    hint = "jaxdp: error: jaxdp {} needs the [torch] extra (not installed: torch): pip install 'jaxdp[torch]'"
    assert hints == [hint.format("parity"), hint.format("bench"), hint.format("export")]


_PUBLIC_NAMES = textwrap.dedent("""
    import sys
    import jaxdp

    listed = dir(jaxdp)
    print("jax imported", "jax" in sys.modules)  # dir() loads nothing: XLA's flags may still come
    print("missing", [name for name in jaxdp.__all__ if name not in listed])
    namespace = {}
    exec("from jaxdp import *", namespace)
    print("star", sorted(name for name in namespace if name != "__builtins__"))
""")


def test_the_public_names_are_listed_before_their_first_use():
    """``jaxdp`` loads its names lazily (XLA's flags come first), yet ``dir(jaxdp)``, and so tab
    completion, lists them all (``__all__``, ``__dir__``) without loading any; ``from jaxdp import *``
    gives exactly them, each the object its module defines."""
    import jaxdp

    assert {"Trainer", "ZeRO", "global_mean", "clip_by_global_norm", "classifier", "make_mesh"} <= set(jaxdp.__all__)
    assert sorted(jaxdp.__all__) == sorted(lazy_exports())
    done = subprocess.run([sys.executable, "-c", _PUBLIC_NAMES], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["jax imported False", "missing []", f"star {sorted(jaxdp.__all__)}"]
    import importlib

    for name, module in lazy_exports().items():
        assert getattr(jaxdp, name) is getattr(importlib.import_module(f"jaxdp.{module}"), name)
