"""``python -m jaxdp.cli``: the ``jaxdp`` command without its installed script."""

import sys

from jaxdp.cli.command import main

sys.exit(main())
