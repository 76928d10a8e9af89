"""The wire contract: what agents and consoles write to and read from Redis.

Every key (:mod:`.keyspace`, the only module that spells one), every record by family
(:mod:`.event_records`, :mod:`.command_records`, :mod:`.log_records`, :mod:`.round_records`,
:mod:`.trace_records`) with the common guards they decode through (:mod:`.protocol`),
terminal-safe text (:mod:`.text`), stack dumps and collective traces with their analysis
(:mod:`.stack_dumps`, :mod:`.collectives`), and the request/reply exchanges both sides run
over the command stream (:mod:`.stack_replies`, :mod:`.collective_replies`).

Shared by the agent and the console: no Textual, no torch, no connection handling, nothing
else of the agent (import contracts in pyproject.toml). Everything read here is hostile input,
decoded in one guarded place and bounded.
"""
