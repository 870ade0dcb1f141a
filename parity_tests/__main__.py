"""``python -m parity_tests ...`` is ``jaxdp parity ...`` (see ``parity_tests.command``)."""

import sys


def main(argv=None) -> int:
    from jaxdp.cli.command import main as jaxdp_main

    return jaxdp_main(["parity", *(sys.argv[1:] if argv is None else argv)])


# The guard matters: torch_ref's launcher starts its ranks with "spawn", which re-imports
# the main module in every child.
if __name__ == "__main__":
    sys.exit(main())
