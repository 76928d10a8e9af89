"""The coordination layer: everything agents (and the console) agree on through Redis.

``protocol`` and ``connection`` are the only modules the console may import; ``torch_compat``
is the only module that imports torch. Nothing here imports ``elastic_agent.supervision``.
"""
