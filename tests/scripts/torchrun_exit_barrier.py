"""torchrun (``torch.distributed.run``'s ``main``, what the ``torchrun`` command runs) with its
agent's exit barrier set by ``$EXIT_BARRIER_TIMEOUT`` seconds: torchrun 2.13 builds its
``LocalElasticAgent`` with the default ``exit_barrier_timeout`` (300 s) and has no flag,
``--rdzv-conf`` key or variable for it. Everything else is torchrun's own code."""

import os

from torch.distributed.launcher import api


class _Agent(api.LocalElasticAgent):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_barrier_timeout", float(os.environ["EXIT_BARRIER_TIMEOUT"]))
        super().__init__(*args, **kwargs)


api.LocalElasticAgent = _Agent  # launch_agent builds the agent by this name

if __name__ == "__main__":
    from torch.distributed.run import main

    main()
