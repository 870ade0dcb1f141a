"""What every jaxdp command line shares: parser settings and renamed flags.

One vocabulary across train, parity, bench, inspect and launch (``--devices``,
``--global-batch-size``, ``--accum-steps``, ...). A flag that had another name keeps it
for one release: the old spelling still works and says what replaced it.
"""

import argparse
import sys

# No abbreviations (argparse would take --epoch for --epochs, silently), and every
# option's default in its help.
PARSER_OPTIONS = dict(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def comma_ints(text: str):
    """``--blocks 1,1,1,1``: a tuple of integers, or argparse's one-line error."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def comma_floats(text: str):
    """``--betas 0.9,0.999``: a tuple of numbers, or argparse's one-line error."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def deprecated_alias(parser, old: str, new: str, **kwargs) -> None:
    """Accept ``old`` as ``new`` (same ``dest`` and ``type``, given in ``kwargs``), hidden
    from --help, with a one-line notice on stderr when used."""

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"jaxdp: {old} is deprecated and will be removed in the next release; use {new}",
                  file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, action=Alias, help=argparse.SUPPRESS, **kwargs)
