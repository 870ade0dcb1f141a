"""``python -m torch_commands.gpu_check``."""

import sys

from torch_commands.gpu_check.command import main

if __name__ == "__main__":  # the guard matters: torch_ref's ranks re-import the main module
    sys.exit(main())
