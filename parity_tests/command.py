"""``jaxdp parity`` (and ``python -m parity_tests``): its options and the run that prints and
writes the report. Registered with ``jaxdp`` as the entry point ``PARITY`` (``jaxdp.commands``):
it needs the [torch] extra.

Jax- and torch-free at import: the parser is built before ``--devices`` reaches XLA.
"""

from __future__ import annotations

import argparse
import math
import sys

from jaxdp.cli.commands import Command
from jaxdp.config.flags import comma_floats, comma_ints
from parity_tests import layouts, pairs, parity_mode, report, runner
from parity_tests.config import ParityConfig, ParityError


def add_parity_args(p: argparse.ArgumentParser) -> None:
    """The ``jaxdp parity`` arguments (also ``python -m parity_tests``)."""
    d = ParityConfig()
    g = p.add_argument_group("pair")
    from jaxdp.config import choices
    from jaxdp.config.flags import add_mesh_flag, add_strategy_flags, add_vit_flags, deprecated_alias

    g.add_argument("--strategy", default=d.strategy, metavar=choices.listing(pairs.PAIRS), help="jaxdp strategy")
    g.add_argument("--devices", type=int, default=None,
                   help=f"jaxdp devices = torch ranks (on CPU the devices are simulated; default {d.devices})")
    add_mesh_flag(g, what="data=N; data=N,model=M: tensor-parallel parity of a ViT or ResNet against its torch "
                          "twin; data=N,stage=S: pipeline parity of a ViT against torch's ScheduleGPipe "
                          "(parity_tests.layouts)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="pipeline micro-batches per device with a stage axis in --mesh (default: the stage count)")
    g.add_argument("--pair", default=None, metavar="MODULE:FUNCTION",
                   help="your own pair of models instead of the built-in ResNet/ViT: a function returning a "
                        "parity_tests.own.ModelPair, e.g. examples.parity_own_model:make_pair (docs/parity.md, "
                        "'Your own models'); the model and data options do not apply, and --inject-bug takes the "
                        "pair's bugs: layernorm_eps | missing_bias | transposed_weight | loss_wrong_axis | "
                        "skipped_grad_sync")
    add_strategy_flags(g, d, sync_bn_help="global BN statistics (torch: see the pair table)",
                       staleness_help="async: only 0 has a torch twin")
    deprecated_alias(g, "--accum", "--accum-steps", dest="accum_steps", type=int)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model, metavar=choices.listing(choices.MODELS), help="architecture")
    g.add_argument("--width", type=int, default=d.width, help="ResNet: channels of the first stage (64 = torchvision)")
    g.add_argument("--blocks", type=comma_ints, default=d.blocks, help="ResNet: blocks per stage, e.g. 1,1,1,1 or 2,2,2,2")
    g.add_argument("--stem", default=d.stem, metavar=choices.listing(choices.STEMS), help="ResNet stem")
    add_vit_flags(g)
    g.add_argument("--dtype", default=d.dtype, metavar=choices.listing(choices.DTYPES), help="float64 (tight: 1e-10) | float32 (measured-noise bounds) | bfloat16 (bf16 compute, fp32 master weights; bounds from bf16 rounding)")
    g.add_argument("--steps", type=int, default=d.steps, help="updates compared")
    g.add_argument("--batch-per-device", type=int, default=d.batch_per_device, help="images per device per update")
    g.add_argument("--image-size", type=int, default=d.image_size, help="centre crop S x S of the 32x32 images")
    g.add_argument("--dataset-size", type=int, default=d.dataset_size, help="synthetic training images")
    g.add_argument("--seed", type=int, default=d.seed, help="init and data order")
    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", default=d.optimizer, metavar=choices.listing(choices.OPTIMIZERS), help="torch.optim's semantics")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--momentum", type=float, default=d.momentum, help="sgd momentum")
    g.add_argument("--nesterov", action="store_true", help="sgd: Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 (sgd, adam) or decoupled (adamw)")
    g.add_argument("--betas", type=comma_floats, default=d.betas, help="adam, adamw: b1,b2")
    g.add_argument("--eps", type=float, default=d.eps, help="adam, adamw")
    g.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm,
                   help="clip the gradients' global norm to this first (torch: clip_grad_norm_; jaxdp.clip_by_global_norm)")
    g.add_argument("--schedule", default=d.schedule, metavar=choices.listing(choices.SCHEDULES), help="lr schedule over the updates")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="warmup_cosine: linear warmup updates")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/parity", help="report.json and parity.png go here")
    g.add_argument("--png", default=None, help="also write the plot to this path (e.g. docs/parity.png)")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="seconds before the torch ranks are killed")
    g.add_argument("--backend", choices=("auto", "nccl", "gloo"), default=d.backend,  # torch_ref.dist.BACKENDS
                   help="torch side's process group. auto (default): $JAXDP_TORCH_BACKEND if set, else nccl "
                        "when CUDA has a GPU for every torch rank (rank r on cuda:r), else gloo. nccl without "
                        "enough GPUs is an error; gloo keeps torch on the CPU, also on a GPU host")
    g.add_argument("--torch-cudnn", choices=("on", "off"), default=d.torch_cudnn,
                   help="off: torch without cuDNN (its own CUDA convolutions), a slow reference when the "
                        "question is which convolution engine a side picked (parity_tests.parity_mode)")
    g.add_argument("--inject-bug", default=None, metavar="BUG",
                   help="demo: run jaxdp with a deliberate bug (same_padding | biased_var | "
                        "missing_1_over_n | wrong_shard_bn | late_lr_schedule (needs --schedule "
                        "warmup_cosine, --steps >= --warmup-steps + 2) | adam_bias_correction (adam, "
                        "adamw) | shard_grad_perturbation (float64 only sees it) | error_feedback_dropped "
                        "(--compress powersgd, --steps >= --powersgd-start-iter + 2)) and watch the harness "
                        "name it; exit status 1 when it is caught, 3 when it is not (the harness is broken)")


def config_from_args(args: argparse.Namespace) -> ParityConfig:
    """The run's config; ``--mesh`` (checked against ``--devices``) sets the device count."""
    from jaxdp.runtime.mesh import mesh_sizes

    fields = ParityConfig.__dataclass_fields__
    given = {k: v for k, v in vars(args).items() if k in fields and not (k == "devices" and v is None)}
    if args.mesh:
        given["devices"] = math.prod(mesh_sizes(args.mesh, args.devices).values())
    return ParityConfig(**given)


def cmd_parity(args: argparse.Namespace) -> int:
    from jaxdp.runtime.mesh import MeshError, parse_mesh, simulate_cpu_devices
    from jaxdp.strategies import StrategyError

    try:
        cfg = config_from_args(args)
        simulate_cpu_devices(cfg.devices)  # before jax starts; a no-op once XLA_FLAGS fixes the count
        parity_mode.enable()  # comparable cuDNN engines on GPUs; also before jax starts
        if args.pair:  # a user's own pair (parity_tests.own): its models, data and bugs
            from parity_tests.own import PairRun, run_pair

            result = run_pair(args.pair, PairRun(**cfg.to_json()), bug=args.inject_bug)
        else:
            sizes = parse_mesh(cfg.mesh) if cfg.mesh else {"data": cfg.devices}
            layout = layouts.layout_of(sizes, cfg.microbatches)
            if layout in layouts.RUNNERS:
                return layouts.RUNNERS[layout](cfg, sizes, args.out, args.inject_bug)
            result = runner.run_parity(cfg, bug=args.inject_bug)
    except (ParityError, MeshError, StrategyError) as e:
        print(f"jaxdp parity: error: {e}", file=sys.stderr)
        return 2
    report.print_report(result)
    paths = report.write(result, args.out, extra_png=args.png)
    print("wrote " + ", ".join(paths))
    if result.missed_bug:
        print(f"jaxdp parity: error: {result.message()}", file=sys.stderr)
        return 3
    return 0 if result.passed else 1


PARITY = Command("step-by-step parity of a jaxdp strategy with its PyTorch twin", add_parity_args, cmd_parity,
                 requires=("torch",))
