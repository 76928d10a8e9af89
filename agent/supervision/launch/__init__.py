"""Launch: starting and ending one host's workers.

- :mod:`.workers`: the process group (start through a keeper, park and release ahead of a
  restart, watch exits, signal, stop whole trees);
- :mod:`.worker_env`: what a worker is given (its spec, torchrun's environment, argv, logs);
- :mod:`.exits`: how a worker started and ended (states, exits, the error file read as
  untrusted input);
- :mod:`.keeper_client` and :mod:`.keeper`: the agent's end of a keeper, and the keeper that
  forks and reaps the workers;
- :mod:`.zygote`: the preloaded process that forks keepers ahead of a restart, and every
  Python worker's bootstrap;
- :mod:`.strays`: finding and ending what a worker left behind;
- :mod:`.probes` and :mod:`.recorder_probe`: the agent's end of the probes inside each worker
  (stack FIFO, recorder socket), and the worker's trace thread.

Launch writes worker output through ``records`` and never imports ``diagnosis``, which asks
the workers through the probes made here (an import contract in pyproject.toml).
"""
