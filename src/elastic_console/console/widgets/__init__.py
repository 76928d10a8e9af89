"""Textual widgets of the console."""

from .log_view import LogBuffer, LogLine, LogView

__all__ = ["LogBuffer", "LogLine", "LogView"]
