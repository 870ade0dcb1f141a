"""The ``jaxdp`` command line: ``command.py`` (train, launch, inspect and the entry-point commands),
``commands.py`` (the subcommands other packages register) and ``launch.py`` (``jaxdp launch``).
Nothing here imports jax at import time: XLA's flags are set after parsing (``jaxdp.runtime.startup``)."""
