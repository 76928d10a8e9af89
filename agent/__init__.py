"""elastic_agent: the per-host agent of Elastic Console (source folder ``agent/``).

Two layers, one subpackage each:

- ``coordination``: the wire contract shared with the console (``protocol``), Redis clients
  (``connection``), the c10d-style store, the elastic rendezvous, free ports, and the torch
  adapter and torchrun plugin. It never imports ``supervision`` (an import-linter contract).
- ``supervision``: the local worker group, log capture and publishing, events, commands, the
  agent's state machine, its configuration and CLI, and the embedded ``--standalone`` Redis.
"""
