"""Diagnosis: why a job is slow, hung or failing, found without code changes.

Stacks on demand (:mod:`.stacks`), torch's flight recorder read from every rank
(:mod:`.recorder`), stall detection (:mod:`.stall`), slow ranks (:mod:`.stragglers`), restart
storms and "do not requeue" (:mod:`.restart_patterns`, :mod:`.pattern_watch`), the
torch-compatible timer watchdog (:mod:`.watchdog`) and the training metrics read from the
workers' output (:mod:`.metric_lines`, :mod:`.metrics`, :mod:`.metrics_publish`). Diagnosis
sits above ``launch`` (it asks the workers through :mod:`..launch.probes`) and ``records`` (it
publishes its findings there), and below the agent's loop, which starts and feeds it.
"""
