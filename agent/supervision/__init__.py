"""The supervision layer: one host's workers, their output, and the agent that drives them.

The agent itself sits here: its loop (:mod:`.elastic_agent`) with its parts beside it
(:mod:`.agent_base`, :mod:`.membership`, :mod:`.restart_path`, :mod:`.job_end`,
:mod:`.command_handling`), its flags (:mod:`.config`, :mod:`.cli`) and its helpers (health
check, fence, failures, exit barrier, run summary, loops, the sync bridge to Redis). Below it,
four rooms, each importing only the rooms under it (pyproject.toml's import contracts):

    diagnosis/  why a job is slow, hung or failing (stacks, recorder, stall, stragglers,
                restart patterns, watchdog)
    launch/     starting and ending the workers (process group, environment, keeper, zygote,
                the probes' channels)
    records/    what the agent writes (logs, events, job records, replies, commands)
    hosting/    running where the job runs (embedded Redis, SLURM, scheduler signals),
                apart from the other three

It builds on ``elastic_agent.coordination`` and is never imported by it.
"""
