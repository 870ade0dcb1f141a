"""jaxdp train's flags, config-file keys and resume fingerprint all come from one tree of
fields (``jaxdp.config.tree``): one declaration per option, nothing listed a second time."""

import dataclasses

import pytest

from jaxdp.config import files as config_file
from jaxdp.cli.command import build_parser
from jaxdp.config.tree import SECTIONS, TrainConfig
from jaxdp.config.fields import declared, number_fields

FIELDS = dataclasses.fields(TrainConfig)


def train_parser():
    return build_parser("train")._subparsers._group_actions[0].choices["train"]


def test_every_field_is_declared_once_in_one_section():
    in_sections = [f.name for section in SECTIONS.values() for f in declared(section)]
    assert sorted(in_sections) == sorted({f.name for f in FIELDS})  # each field in exactly one section...
    assert {f.name for f in declared(TrainConfig)} == {f.name for f in FIELDS}  # ...with its help and its numbers
    assert all(f.metadata["help"] for f in FIELDS)


def test_every_field_is_a_flag_and_a_config_key():
    dests = {a.dest for a in train_parser()._actions} - {"help", "config"}
    assert dests == {f.name for f in FIELDS}
    assert set(config_file.FIELDS) == {f.name for f in FIELDS}
    defaults = vars(train_parser().parse_args([]))
    assert {f.name: defaults[f.name] for f in FIELDS} == dataclasses.asdict(TrainConfig())  # one default each


def test_the_fingerprint_is_exactly_the_fields_that_change_the_numbers():
    numbers = {f.name for f in FIELDS if f.metadata["numbers"]}
    assert set(TrainConfig().fingerprint()) == numbers == set(number_fields(TrainConfig))
    assert {"lr", "seed", "global_batch_size", "accum_steps", "allreduce", "model"} <= numbers
    assert not {"strategy", "devices", "mesh", "out", "remat", "bucket_cap_mb", "progress"} & numbers


@pytest.mark.parametrize("name, value, changes", [("lr", 0.5, True), ("blocks", (1, 1, 1, 1), True),
                                                  ("remat", "none", False), ("devices", 2, False)])
def test_a_field_enters_the_fingerprint_as_it_is_declared(name, value, changes):
    assert (TrainConfig(**{name: value}).fingerprint() != TrainConfig().fingerprint()) == changes


def test_a_flag_sets_its_field(tmp_path):
    """Parsed through the generated parser and the generated config-file loader alike."""
    from jaxdp.cli.command import config_from_args

    args = train_parser().parse_args(["--remat", "none", "--blocks", "1,2,1,1", "--no-progress", "--sync-bn",
                                      "--batch-size", "64", "--profile-steps", "2:4"])
    cfg = config_from_args(args)
    assert (cfg.remat, cfg.blocks, cfg.progress, cfg.sync_bn, cfg.global_batch_size, cfg.profile_steps) == (
        "none", (1, 2, 1, 1), False, True, 64, (2, 4))
    path = tmp_path / "run.toml"
    path.write_text('remat = "none"\nblocks = [1, 2, 1, 1]\nprogress = false\n')
    assert config_file.load(str(path)) == {"remat": "none", "blocks": (1, 2, 1, 1), "progress": False}


def test_the_parser_starts_no_jax_so_devices_can_still_be_set():
    """jaxdp.runtime.startup sets XLA's device flags after parsing: everything the parser needs is jax-free."""
    import subprocess
    import sys

    code = ("import sys; from jaxdp.cli.command import build_parser; build_parser().parse_args(['train', '--devices', '3']); "
            "assert 'jax' not in sys.modules, 'jax imported before the device flags are set'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_startup_asks_each_process_for_its_share_of_the_devices(monkeypatch):
    from jaxdp.runtime import startup

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    startup.configure(8, processes=2)
    assert startup.preset_device_count() == f"{startup.FORCE_FLAG}=4"
    startup.configure(6)  # a count already set stays: jax may have read it
    assert startup.preset_device_count() == f"{startup.FORCE_FLAG}=4"
    assert startup.with_device_count("--a --xla_force_host_platform_device_count=4", 2) == \
        f"--a {startup.FORCE_FLAG}=2"


def test_every_declared_bound_is_checked_in_one_line():
    from jaxdp.config.tree import TrainError, check_config

    bounded = {f.name: f.metadata["at_least"] for f in FIELDS if f.metadata["at_least"] is not None}
    assert {"global_batch_size", "accum_steps", "devices", "epochs", "keep", "max_steps"} <= set(bounded)
    for name, minimum in bounded.items():
        check_config(TrainConfig(**{name: minimum}))
        with pytest.raises(TrainError, match=f"^--{name.replace('_', '-')} must be >= {minimum}"):
            check_config(TrainConfig(**{name: minimum - 1}))


def test_which_options_pair_with_torch_and_which_inspect_takes_are_field_metadata():
    """``parity_tests.pairs`` (PAIR_OPTIONS, JAX_ONLY_OPTIONS) and ``jaxdp inspect`` (its strategy flags)
    are the lists ``StrategyOptions``' fields declare (``option(parity=..., inspect=...)``), in
    declaration order: the same lists that were kept by hand before."""
    from jaxdp.cli import inspect_command
    from jaxdp.config.step import StrategyOptions
    from parity_tests import pairs

    meta = {f.name: f.metadata for f in declared(StrategyOptions) if f.metadata["strategy_option"]}
    assert pairs.PAIR_OPTIONS == tuple(n for n, m in meta.items() if m["parity"]) == (
        "bucket_cap_mb", "allreduce", "compress", "powersgd_rank", "staleness", "mesh_shape", "remat", "reduce_dtype",
        "accum_reduce")
    # accum_reduce: torch_ref's FSDP2 twin already syncs once per update (set_requires_gradient_sync)
    assert pairs.JAX_ONLY_OPTIONS == tuple(n for n, m in meta.items() if m["parity"] == "jax-only") == (
        "allreduce", "staleness", "remat", "accum_reduce")
    assert inspect_command.FLAGS == tuple(n for n, m in meta.items() if m["inspect"])
    assert inspect_command.STRATEGY_OPTIONS == ("allreduce", "compress", "powersgd_rank", "staleness", "remat",
                                                "reduce_dtype", "accum_reduce")
    assert meta["powersgd_start_iter"]["parity"] is None  # it rides with --compress powersgd
