"""Hosting: running where the job runs, with what the host provides.

The embedded Redis of ``--standalone`` and of a SLURM step (:mod:`.standalone`,
:mod:`.slurm_redis`), SLURM's variables (:mod:`.slurm`) and a scheduler's signals
(:mod:`.scheduler`). It stands apart from the other rooms: only the agent's loop, its
configuration and its CLI use it.
"""
