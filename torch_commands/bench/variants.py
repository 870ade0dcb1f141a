"""Bench axes over a strategy's own options: ``--remat unit,none`` (zero3, hsdp) and
``--bucket-cap-mb 1,5,25,100,inf`` (ddp, zero1, zero2). A strategy that takes an axis's
option gets one row per value; the others get one row, with their defaults.

Jax- and torch-free at import.
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Dict, List, Sequence

from jaxdp.config.choices import REMATS

# "inf": one bucket. Both sides turn the cap into whole bytes, int(inf) has none: 1e9 MiB is
# more than any model here, so every gradient lands in the first bucket.
ONE_BUCKET_MB = 1e9


def bucket_caps(text: str):
    """``--bucket-cap-mb 1,5,inf``: positive sizes in MiB; ``inf`` is one bucket."""
    try:
        caps = tuple(ONE_BUCKET_MB if x.strip() == "inf" else float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated MiB (or inf), got {text!r}") from None
    if any(not math.isfinite(c) or c <= 0 for c in caps):
        raise argparse.ArgumentTypeError(f"bucket caps must be positive, got {text!r}")
    return caps


def remats(text: str):
    """``--remat unit,none``."""
    values = tuple(x.strip() for x in text.split(","))
    bad = [v for v in values if v not in REMATS]
    if bad:
        raise argparse.ArgumentTypeError(f"--remat takes {', '.join(REMATS)}, got {', '.join(bad)}")
    return values


def add_variant_args(p) -> None:
    p.add_argument("--remat", type=remats, default=None,
                   help="zero3/hsdp rows per value, e.g. unit,none (default: unit only)")
    p.add_argument("--bucket-cap-mb", dest="bucket_cap_mb", type=bucket_caps, default=None,
                   help="ddp/zero1/zero2 rows per gradient bucket cap in MiB, e.g. 1,5,25,100,inf (inf: one "
                        "bucket; default: torch's 25 with a 1 MiB first bucket)")


def axes_from(args) -> Dict[str, Sequence]:
    """The axes the command line gave: option name -> values."""
    return {k: v for k, v in (("remat", args.remat), ("bucket_cap_mb", args.bucket_cap_mb)) if v}


def variants(name: str, axes: Dict[str, Sequence]) -> List[dict]:
    """One option dict per row of strategy ``name``: the product of the axes it takes."""
    from jaxdp.strategies import options_of

    takes = options_of(name)
    mine = {k: v for k, v in axes.items() if k in takes}
    return [dict(zip(mine, values)) for values in itertools.product(*mine.values())]


def label(options: dict) -> str:
    """How a row's options read in the strategy column: `` remat=none``, `` bucket=inf``."""
    words = {"remat": lambda v: f"remat={v}",
             "bucket_cap_mb": lambda v: "bucket=inf" if v >= ONE_BUCKET_MB else f"bucket={v:g}MB"}
    return "".join(" " + words[k](v) for k, v in options.items())
