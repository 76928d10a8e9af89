"""Reaching Redis: endpoints, clients, and the way commands travel.

Endpoints and where their passwords come from, with redaction (:mod:`.endpoints`); the plain
clients and the one-connection gate (:mod:`.connection`); Sentinel and Cluster
(:mod:`.sentinel`, :mod:`.cluster`); the lean send path (:mod:`.send_path`), scripts run by
hash (:mod:`.lua`), the server's memory pressure (:mod:`.pressure`) and one multiplexed
blocking read per agent (:mod:`.stream_mux`). Shared by the agent and the console; it builds
on :mod:`..wire` and never imports the rendezvous, the store or torch.
"""
