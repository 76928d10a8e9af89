"""The coordination layer: everything agents (and the console) agree on through Redis.

    wire/        the wire contract: keys, records, their guarded decoding (the console's too)
    transport/   reaching Redis: endpoints, clients, Sentinel, Cluster (the console's too)
    rendezvous/  nodes meet, form rounds, beat, and notice who is lost
    store.py     torch's c10d Store semantics on Redis, and barriers
    torch_compat.py, torch_plugin.py  torch's Store and RendezvousHandler over the above;
                 torch_compat is the only module that imports torch
    ports.py     free ports

Nothing here imports ``elastic_agent.supervision`` (import contracts in pyproject.toml).
"""
