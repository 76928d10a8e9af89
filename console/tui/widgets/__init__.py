"""Textual widgets of the console, one module per area.

``log_view`` (LogView over a LogBuffer; the Textual-free line rendering and visible-line index
beside it in ``log_lines`` and ``log_index``), ``header`` (job facts, the Redis banner),
``rank_table`` (its columns and cells in ``rank_rows``), ``timeline``, ``sparklines``
(CPU/RSS of the selected rank), ``log_panel``
(the log title and the ``/`` filter bar), ``dialogs`` (confirm a command, an entry in full),
``help`` (the ``?`` screen), ``footer`` (the keys), ``waiting`` (the job does not exist yet); ``common`` turns
untrusted text into Rich ``Text`` and formats numbers.
"""

from .log_view import LogBuffer, LogLine, LogView

__all__ = ["LogBuffer", "LogLine", "LogView"]
