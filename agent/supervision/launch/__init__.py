"""Launch: starting and ending one host's workers.

The process group (:mod:`.workers`), the environment each worker gets (:mod:`.worker_env`),
the keeper that forks and reaps them (:mod:`.keeper`), the zygote that preloads and forks
keepers ahead of a restart (:mod:`.zygote`), and the agent's end of the probes inside each
worker (:mod:`.probes`, :mod:`.recorder_probe`). Launch writes worker output through
``records`` and never imports ``diagnosis``, which asks through the probes made here.
"""
