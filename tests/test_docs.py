"""The docs say what the code does: every command they show is one the code accepts, every
relative link resolves, the README stays one screen and its API example runs.

Commands come from the shell blocks of README.md and docs/*.md (fenced blocks tagged bash,
sh, shell or console, or untagged; in console blocks only the ``$ `` lines), with
backslash-continued lines joined. ``jaxdp SUB ...`` is parsed by jaxdp's own parser, its
names checked against the listed choices, and, for ``train`` and ``parity``, put through the
checks that run before any data is loaded. ``jaxdp launch ... -- CMD`` and ``srun CMD``
check CMD too; ``python -m parity_tests[.gpu_check] ...`` and ``[torchrun ...] -m
torch_ref.train ...`` go through their own parsers, ``python examples/X.py`` needs the file,
``make X`` needs target X in the Makefile. In a command, ``...`` stands for options left
out and is dropped; a line whose comment starts with ``fails:`` shows an error on purpose
and is skipped.
"""

import contextlib
import glob
import importlib.util
import io
import os
import re
import shlex

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = (";", "&&", "||", "|", "&")
README_LIMIT = 6 * 1024  # bytes: the README is one screen; the rest lives in docs/


class Refused(Exception):
    """A documented command that the code would not accept."""


def read(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------- finding commands

def split_fences(text):
    """(language, [(line number, line)]) per fenced block, and the prose lines outside them."""
    blocks, prose, block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence and block is None:
            block = (fence.group(2).lower(), [])
        elif fence and not fence.group(2):
            blocks.append(block)
            block = None
        elif block is not None:
            block[1].append((number, line))
        else:
            prose.append(line)
    return blocks, prose


def joined(lines):
    """Backslash-continued lines as one, numbered by their first line."""
    start, parts = None, []
    for number, line in lines:
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        yield start, " ".join(parts + [line])
        start, parts = None, []
    if parts:
        yield start, " ".join(parts)


def shell_commands(text):
    """(line number, argv) of every simple command in the text's shell blocks."""
    blocks, _ = split_fences(text)
    for language, lines in blocks:
        if language not in SHELL_LANGUAGES:
            continue
        for number, line in joined(lines):
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            elif language == "console" or re.search(r"#\s*fails:", line):
                continue  # output, or an error shown on purpose
            for argv in simple_commands(line):
                yield number, argv


def simple_commands(line):
    """The argv of each command in a shell line (split at ; && || | &), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    argv = []
    for token in [*lexer, ";"]:
        if token in SEPARATORS:
            if argv:
                yield argv
            argv = []
        else:
            argv.append(token)


# ----------------------------------------------------------------------------- checking one command

def check(argv):
    """Raise Refused if the code would not accept ``argv``; commands of other programs pass."""
    argv = [token for token in argv if token != "..."]
    while argv and ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    if not argv:
        return
    program, args = os.path.basename(argv[0]), argv[1:]
    if program == "srun":
        check(args[next((i for i, a in enumerate(args) if not a.startswith("-")), len(args)):])
    elif program == "jaxdp":
        check_jaxdp(args)
    elif program in ("python", "python3", "torchrun") and "-m" in args:
        module = args.index("-m") + 1
        check_module(args[module], args[module + 1:])
    elif program in ("python", "python3") and args and args[0].endswith(".py"):
        if not os.path.isfile(os.path.join(ROOT, args[0])):
            raise Refused(f"no file {args[0]}")
    elif program == "make":
        check_make(args)
    elif program in ("bash", "sh") and args[:1] == ["-c"] and len(args) > 1:
        for command in simple_commands(args[1]):
            check(command)


def parse(parser, args):
    """argparse's result, or Refused with its one-line error (a deprecated flag's notice too)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            namespace = parser.parse_args(args)
    except SystemExit as e:
        if e.code == 0:  # --help, --version
            return None
        raise Refused(err.getvalue().strip().splitlines()[-1]) from None
    if err.getvalue():
        raise Refused(err.getvalue().strip())
    return namespace


def check_choices(parser, namespace):
    """Names are checked by the library, not argparse: its --help lists them as {a,b,c}."""
    for action in parser._actions:
        listed = re.fullmatch(r"\{(.*)\}", action.metavar or "")
        value = getattr(namespace, action.dest, None)
        if listed and value is not None and value not in listed.group(1).split(","):
            raise Refused(f"{action.option_strings[0]} {value!r} is not one of {listed.group(0)}")


def check_training(parser, namespace):
    """What ``jaxdp train`` and ``torch_ref.train`` refuse before they load any data."""
    from jaxdp.cli.command import config_from_args
    from jaxdp.config.tree import check_config

    check_choices(parser, namespace)
    check_config(config_from_args(namespace))


def check_jaxdp(args):
    from jaxdp.cli.command import build_parser

    parser = build_parser()
    namespace = parse(parser, args)
    if namespace is None:
        return
    sub = parser._subparsers._group_actions[0].choices[namespace.command]
    if namespace.command == "train":
        check_training(sub, namespace)
        return
    check_choices(sub, namespace)
    if namespace.command == "parity":
        check_parity(namespace)
    elif namespace.command == "launch":
        command = namespace.cmd[1:] if namespace.cmd[:1] == ["--"] else namespace.cmd
        if not command:
            raise Refused("jaxdp launch without a command to run")
        check(command)


def check_parity(namespace):
    """What ``jaxdp parity`` refuses before it runs: a pair with no twin, an option the pair
    does not take, a bug that cannot show."""
    from parity_tests import bugs
    from parity_tests.command import config_from_args
    from parity_tests.plan import plan

    cfg = config_from_args(namespace)
    if namespace.pair:  # a pair of the user's own: its own refusals (parity_tests.own)
        from parity_tests.own import PairRun
        from parity_tests.own.runner import plan_pair

        plan_pair(namespace.pair, PairRun(**cfg.to_json()), namespace.inject_bug)
        return
    plan(cfg)
    if namespace.inject_bug:
        bugs.injection(namespace.inject_bug, cfg)


def check_module(module, args):
    if module == "parity_tests":
        check_jaxdp(["parity", *args])
    elif module == "torch_commands.gpu_check":
        import argparse

        from torch_commands.gpu_check.command import add_args

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_args(parser)
        parse(parser, args)
    elif module == "parity_tests.error_budget":
        from parity_tests.error_budget import build_parser

        parse(build_parser(), args)
    elif module == "parity_tests.own.matrix":
        from parity_tests.own.matrix import build_parser

        parse(build_parser(), args)
    elif module == "torch_ref.train":
        from torch_ref.train import build_parser

        parser = build_parser()
        namespace = parse(parser, args)
        if namespace is not None:
            check_training(parser, namespace)


def makefile_targets():
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", read("Makefile"), re.M))


def check_make(args):
    targets = [a for a in args if not a.startswith("-") and not ASSIGNMENT.match(a)]
    missing = [t for t in targets if t not in makefile_targets()]
    if missing:
        raise Refused(f"no Makefile target {', '.join(missing)}")


def problems(doc, text):
    """One line per refused command: where it is, what it is, why."""
    from jaxdp.config.tree import TrainError
    from parity_tests.config import ParityError

    found = []
    for number, argv in shell_commands(text):
        try:
            check(argv)
        except (Refused, TrainError, ParityError) as e:  # the library's own one-line refusals
            found.append(f"{doc}:{number}: {shlex.join(argv)}\n    {e}")
    return found


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("doc", DOCS)
def test_every_command_shown_is_accepted(doc):
    found = problems(doc, read(doc))
    if found:
        pytest.fail("\n".join(found), pytrace=False)


def test_the_docs_show_commands_of_every_kind():
    """The extraction finds what the docs hold: a check of nothing would pass."""
    programs = {os.path.basename(argv[0]) for doc in DOCS for _, argv in shell_commands(read(doc))}
    assert {"jaxdp", "make", "torchrun", "srun"} <= programs, programs
    modules = {argv[argv.index("-m") + 1] for doc in DOCS for _, argv in shell_commands(read(doc)) if "-m" in argv}
    assert {"torch_ref.train", "torch_commands.gpu_check"} <= modules, modules


BAD = """
```bash
$ .venv/bin/jaxdp train --epoch 2
jaxdp train --strategy zero4
jaxdp launch --nprocs 2 -- .venv/bin/jaxdp train --width 4 \\
    --global-batch-size 32 --synthetc-size 256,64
srun .venv/bin/jaxdp train --schedule multistep
make trian
.venv/bin/torchrun --nproc_per_node 2 -m torch_ref.train --optimizer lamb
.venv/bin/python -m torch_commands.gpu_check --dry_run
jaxdp parity --strategy zero2 --inject-bug missing_one_over_n
python examples/no_such_example.py
jaxdp train --epoch 2   # fails: shown on purpose
```
```text
jaxdp train --epoch 2
```
"""


def test_a_wrong_command_is_named_with_its_line_and_reason():
    found = problems("doc.md", BAD)
    assert len(found) == 9, "\n".join(found)
    expected = [
        ("doc.md:3:", "unrecognized arguments: --epoch 2"),
        ("doc.md:4:", "--strategy 'zero4' is not one of {ddp,"),
        ("doc.md:5:", "unrecognized arguments: --synthetc-size"),
        ("doc.md:7:", "--schedule multistep needs --milestones"),
        ("doc.md:8:", "no Makefile target trian"),
        ("doc.md:9:", "--optimizer 'lamb' is not one of {sgd,adam,adamw}"),
        ("doc.md:10:", "unrecognized arguments: --dry_run"),
        ("doc.md:11:", "unknown bug 'missing_one_over_n'"),
        ("doc.md:12:", "no file examples/no_such_example.py"),
    ]
    for (where, why), problem in zip(expected, found):
        assert problem.startswith(where) and why in problem, problem


def anchors(doc):
    """GitHub's ids for the headings of ``doc``: lower case, punctuation dropped, spaces to hyphens."""
    _, prose = split_fences(read(doc))
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in prose if line.startswith("#")}


def test_relative_links_point_to_files_and_headings_that_exist():
    broken = []
    for doc in DOCS:
        _, prose = split_fences(read(doc))
        text = re.sub(r"`[^`]*`", "", "\n".join(prose))  # code spans hold no links
        for target in re.findall(r"\]\(([^)\s]+)", text):
            path, _, anchor = target.partition("#")
            if re.match(r"^[a-z]+:", path):
                continue  # a web address
            linked = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(ROOT, linked)):
                broken.append(f"{doc}: {target}: no file {linked}")
            elif anchor and linked.endswith(".md") and anchor not in anchors(linked):
                broken.append(f"{doc}: {target}: no heading #{anchor} in {linked}")
    if broken:
        pytest.fail("\n".join(broken), pytrace=False)


def test_every_docs_page_is_linked_from_the_readme():
    readme = read("README.md")
    assert [d for d in DOCS[1:] if f"]({d})" not in readme] == []


def test_readme_is_one_screen():
    assert len(read("README.md").encode()) <= README_LIMIT


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_readme_api_example_runs(tmp_path, monkeypatch):
    """The README's API example, NNX first (with the model and batches of examples/custom_model_nnx.py),
    then its Linen loss on examples/custom_model.py's model, which computes the contract's output."""
    import jax
    import optax

    monkeypatch.chdir(tmp_path)  # its checkpoint goes there
    blocks, _ = split_fences(read("README.md"))
    nnx_code, linen_code = ["\n".join(line for _, line in lines) for language, lines in blocks if language == "python"]
    assert len(nnx_code.splitlines()) <= 15 and len(linen_code.splitlines()) <= 4
    example = _example("custom_model_nnx")
    batches = example.batches(2)
    namespace = dict(TinyLM=example.TinyLM, Block=example.Block, example_batch=next(batches), batch=next(batches))
    exec(nnx_code, namespace)
    assert np.isfinite(float(namespace["metrics"]["loss"]))
    assert isinstance(namespace["model"], example.TinyLM)

    linen = _example("custom_model")
    namespace = dict(model=linen.model, optax=optax)
    exec(linen_code, namespace)
    batch = next(linen.batches(1))
    variables = jax.jit(linen.model.init)(jax.random.key(0), batch["tokens"][:, :-1])
    loss, (model_state, metrics) = jax.jit(namespace["loss_fn"])(variables["params"], {}, batch, None)
    assert np.isfinite(float(loss)) and model_state == {} and metrics == {}


# ----------------------------------------------------------------------------- standing alone

SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "node_modules"}


def repository_files(root=ROOT):
    """The repository's files, tracked or not, less what .gitignore ignores (git's own list; without
    git, a walk that skips the environments and caches)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return [os.path.join(root, p) for p in listed if p and os.path.isfile(os.path.join(root, p))]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".venv"))
            found += [os.path.join(folder, f) for f in sorted(files)]
        return found


def citations(name, root=ROOT):
    """``path:line`` of every text file of the repository at ``root`` whose line names the file ``name``."""
    found = []
    for path in repository_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except (UnicodeDecodeError, OSError):
            continue  # binary (a png), or unreadable: cites nothing
        found += [f"{os.path.relpath(path, root)}:{n}" for n, line in enumerate(lines, 1) if name in line]
    return found


def test_the_repository_cites_no_design_file_it_does_not_hold():
    """A clone holds everything its code and docs cite: the design notes live in docs/design-notes.md.
    (The name is spelt in two halves, so that this file does not cite it.)"""
    name = "DESIGN" + ".md"
    if os.path.exists(os.path.join(ROOT, name)):
        return
    offenders = citations(name)
    assert not offenders, (f"{len(offenders)} line(s) cite {name}, which the repository does not hold (point to "
                           f"docs/design-notes.md instead): " + ", ".join(offenders))


def test_the_citation_check_finds_a_citation(tmp_path):
    (tmp_path / "pkg" / "data").mkdir(parents=True)
    (tmp_path / "pkg" / "data" / "a.py").write_text("x = 1\n# see " + "DESIGN" + ".md section 3\n")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG\xff\xfe")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "log.txt").write_text("DESIGN" + ".md\n")  # ignored, as .gitignore says
    (tmp_path / ".gitignore").write_text("runs/\n")
    want = [os.path.join("pkg", "data", "a.py") + ":2"]
    assert citations("DESIGN" + ".md", str(tmp_path)) == want + [os.path.join("runs", "log.txt") + ":1"]  # no git
    import subprocess

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert citations("DESIGN" + ".md", str(tmp_path)) == want
