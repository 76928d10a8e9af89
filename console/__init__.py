"""elastic_console: the terminal console of Elastic Console (source folder ``console/``).

``client`` reads a job's streams and sends commands, ``state`` folds records into a view of
the job, ``text`` makes untrusted text safe to show; none of them imports Textual. ``app`` and
``widgets`` are the Textual app; ``cli`` is the ``elastic-console`` command. Of the agent it
imports only ``elastic_agent.coordination.wire.protocol`` and ``.connection``.
"""
