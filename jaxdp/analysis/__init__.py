"""Where the bytes are: per-device model state, compiled memory and collective traffic.

``jaxdp inspect --strategy zero3 --devices 8 --model resnet18 --optimizer adam``
prints, for one strategy on N devices (about 1 min for ResNet-18 on a 2-core CPU,
most of it compiling the step; ``--no-compile`` skips that part):

1. model state per device, measured, beside the ZeRO formulas (``state``);
2. compiled memory per device of the training step (``measure``);
3. collectives per step, counted in the compiled HLO, beside each strategy's
   traffic formula (``hlo`` parses, ``state`` holds the formulas).

``inspect_strategy(name, n, InspectOptions(...))`` (or ``measure`` for a strategy you built, or
``Trainer.inspect`` for yours, ``trainer_inspect``) returns all of it as a dict (``--json`` prints
that); for a GPU target, with an estimated step (``estimate``) and its picture (``plot``);
``report.format_report`` makes it the table; the
``jaxdp inspect`` and ``jaxdp plan`` subcommands are ``jaxdp.cli.inspect_command`` and ``plan_command``,
which import this package when the command runs, after parsing (it imports jax).
"""

from jaxdp.analysis.hlo import COLLECTIVES, compiled_memory, parse_collectives, replica_groups
from jaxdp.analysis.measure import InspectError, check_batchnorm_has_values, fsdp_options, inspect_strategy, measure
from jaxdp.analysis.options import InspectOptions
from jaxdp.analysis.report import format_report
from jaxdp.analysis.state import COMPRESSED_BYTES, formula_bytes, padded_count, param_count

__all__ = ["COLLECTIVES", "COMPRESSED_BYTES", "InspectError", "InspectOptions", "check_batchnorm_has_values", "compiled_memory",
           "format_report", "formula_bytes", "fsdp_options", "inspect_strategy", "measure", "padded_count",
           "param_count", "parse_collectives", "replica_groups"]
