"""The coordination layer: everything agents (and the console) agree on through Redis.

The wire contract (``protocol``, ``keyspace`` and the ``*_records`` modules) and ``connection``
are what the console imports; ``torch_compat`` is the only module that imports torch. Nothing
here imports ``elastic_agent.supervision``.
"""
