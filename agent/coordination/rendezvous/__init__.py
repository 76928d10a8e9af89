"""The rendezvous: nodes meet in Redis, form a round, beat, and notice who is lost.

The Lua scripts that make every transition atomic (:mod:`.scripts`), the data and decoding
of their replies (:mod:`.types`), one node's steps written without I/O (:mod:`.steps`), and
the two drivers that run those steps against Redis (:mod:`.drivers`: blocking for torch's
handler, asyncio for the agent). docs/PROTOCOL.md describes the protocol.
"""
