"""The code's shape: imports go one way, and the jax side stands without the torch side.

The module graph is read from the source with ``ast`` (every import statement, those inside
functions too), so a cycle or a torch import that only runs on some path is still found.
"""

import ast
import graphlib
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdp", "parity_tests", "torch_ref", "torch_commands")
TORCH_SIDE = ("torch", "torch_ref", "parity_tests", "torch_commands")


def modules(root: Path = ROOT) -> dict:
    """{dotted module name: path} for every module of PACKAGES (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(name: str, path: Path) -> set:
    """Every module name ``name`` imports, absolute; ``from a import b`` gives ``a.b`` (b may be
    a module or a name in ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> dict:
    """{module: the project modules it imports}: each imported name resolved to the longest
    module of the project it names."""
    found = modules(root)

    def resolve(dotted: str):
        while dotted and dotted not in found:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in found.items():
        targets = {resolve(n) for n in imported_names(name, path)}
        graph[name] = targets - {None, name}
    return graph


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_reads_function_level_and_relative_imports():
    """The reader itself, on the data package as it stood with its circle (datasets imported
    synthetic inside a function; synthetic imported datasets at the top, relatively)."""
    graph = import_graph()
    assert "jaxdp.data.arrays" in graph["jaxdp.data.synthetic"]  # `from .arrays import ArrayDataset`
    assert {"jaxdp.data.synthetic", "jaxdp.data.cifar10"} <= graph["jaxdp.data.datasets"]  # inside load_dataset
    assert "jaxdp.models.errors" in graph["jaxdp.models.batchnorm"]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({**graph, "jaxdp.data.arrays": {"jaxdp.data.datasets"}}).prepare()


def test_the_jaxdp_root_holds_packages_and_four_one_idea_modules():
    """Folders by concern (docs/architecture.md): a new module goes into the package of its concern.
    (The root's: the weight conversion, the optimizers, and the two jax-free name tables.)"""
    root = sorted(p.stem for p in (ROOT / "jaxdp").glob("*.py"))
    assert root == ["__init__", "interop", "names", "optim", "registry"]
    packages = sorted(p.parent.name for p in (ROOT / "jaxdp").glob("*/__init__.py"))
    assert packages == ["analysis", "api", "cli", "config", "data", "models", "parallel", "run", "runtime", "strategies"]


def test_no_import_cycles():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail("import cycle: " + " -> ".join(e.args[1]))


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
                        "export": "torch_commands.export:EXPORT", "plan": "jaxdp.analysis.plan_command:PLAN"}
    from jaxdp.cli.commands import registered

    assert set(registered()) == set(commands), "stale install metadata: run pip install -e '.[dev]' (make install)"


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
