"""The bodies of `elastic-console`'s subcommands, by family; console/cli.py parses the command
line and dispatches here.

    read         ls, status, events: one read of the jobs or of a job (events may follow)
    logs         logs: the workers' output, filtered, deduplicated, followed
    metrics      metrics: a training metric's curve (JSON, CSV or a table)
    control      restart, stop, rm: the subcommands that change a job
    diagnose     stacks, collectives: ask every rank of a running job (read-only)
    interactive  attach, serve: the console itself, in this terminal or in a browser
    common       what they share: exit statuses, the one-line error, the job's client and
                 view, and standard output under one terminal policy

No Textual: only attach and serve import the app's side, when they run.
"""
