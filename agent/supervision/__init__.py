"""The supervision layer: one host's workers, their output, and the agent that drives them.

It builds on ``elastic_agent.coordination`` (rendezvous, store, protocol, connection) and is
never imported by it.
"""
