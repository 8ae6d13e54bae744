"""``python -m kimi_k3.job``: the ``kimi-k3-train`` command, for launchers that start a module (``torchrun -m``,
``accelerate launch -m``)."""

import sys

from kimi_k3.job.command import main

sys.exit(main())
