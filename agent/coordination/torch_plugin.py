"""The ``torchrun.handlers`` entry point (name ``redis``), kept apart from torch_compat.

torch loads out-of-tree rendezvous handlers while ``torch.distributed.elastic.rendezvous`` is
being imported, and torch_compat imports that package: an entry point inside torch_compat
would be loaded from a half-initialised module and silently not registered. This module
imports nothing of torch; the creator imports torch_compat when torch first calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def create_handler(params: Any) -> Any:
    """Build the ``redis`` backend's ``RendezvousHandler`` from torch's parameters."""
    from .torch_compat import create_handler as create

    return create(params)


def rendezvous_handler_factory() -> Callable[[Any], Any]:
    """A zero-argument factory returning the creator, as torch's registry expects."""
    return create_handler
