"""KeyFooter: the keys of the focused screen on one line, one widget.

Textual's Footer is a container with a widget per key, recomposed (every key unmounted, new
ones mounted, styled and laid out) whenever the screen's bindings change, and they change on
almost every focus change: the log adds ``Follow``, the timeline ``Details``, the filter
input hides the letter keys it takes as text. That cost 20-40 ms and a relayout of the whole
screen inside ``tab``, ``/`` and ``esc`` (bench/console_bench.py --trace-stalls). This footer
renders one ``Text`` instead, and only when the keys it shows changed: no mount, no layout.

It looks like Textual's (same theme variables): each shown binding as ``key description``,
disabled ones dimmed (``check_action`` returned None), the command palette key on the right.
A click on a key presses it, as in Textual's footer; on a disabled one it rings the bell.
"""

from __future__ import annotations

from typing import ClassVar

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events
from textual.screen import Screen
from textual.widget import Widget

__all__ = ["KeyFooter"]

#: (key, key display, description, enabled) of each key shown.
ShownKey = tuple[str, str, str, bool]


class KeyFooter(Widget, can_focus=False):
    """The screen's keys, redrawn only when they change (see the module docstring)."""

    ALLOW_SELECT = False

    COMPONENT_CLASSES: ClassVar[set[str]] = {"key-footer--key", "key-footer--description"}

    DEFAULT_CSS = """
    KeyFooter {
        dock: bottom;
        height: 1;
        color: $footer-foreground;
        background: $footer-background;
        & > .key-footer--key {
            color: $footer-key-foreground;
            background: $footer-key-background;
            text-style: bold;
        }
        & > .key-footer--description {
            color: $footer-description-foreground;
            background: $footer-description-background;
        }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._keys: tuple[ShownKey, ...] = ()
        self._palette: ShownKey | None = None
        self._spans: list[tuple[int, int, ShownKey]] = []  # cells [start, end) -> key

    @property
    def shown(self) -> tuple[ShownKey, ...]:
        """The keys shown, left to right, then the command palette's (if any)."""
        return self._keys + ((self._palette,) if self._palette else ())

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)
        self._bindings_changed(self.screen)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen: Screen[object]) -> None:
        if not self.is_attached or screen is not self.screen:
            return
        app = self.app
        keys: list[ShownKey] = []
        palette: ShownKey | None = None
        actions: set[str] = set()
        for key, (_, binding, enabled, _) in screen.active_bindings.items():
            shown: ShownKey = (binding.key.split(",")[0], app.get_key_display(binding),
                               binding.description, enabled)
            if key == app.COMMAND_PALETTE_BINDING and app.ENABLE_COMMAND_PALETTE:
                palette = shown
            elif binding.show and binding.action not in actions:
                actions.add(binding.action)  # one entry per action, as Textual's footer
                keys.append(shown)
        if (tuple(keys), palette) != (self._keys, self._palette):
            self._keys, self._palette = tuple(keys), palette
            self.refresh()

    def render(self) -> Text:
        key_style = self.get_component_rich_style("key-footer--key", partial=True)
        text_style = self.get_component_rich_style("key-footer--description", partial=True)
        dim = Style(dim=True)
        line = Text(no_wrap=True, overflow="crop", end="")
        self._spans = []
        for shown in self._keys:
            _, display, description, enabled = shown
            start = line.cell_len
            extra = Style() if enabled else dim
            line.append(f" {display} ", key_style + extra)
            line.append(f"{description} " if description else "", text_style + extra)
            self._spans.append((start, line.cell_len, shown))
        if self._palette is not None:
            _, display, description, enabled = self._palette
            right = f"▏{display} {description} "
            pad = self.size.width - line.cell_len - cell_len(right)
            if pad > 0:
                line.append(" " * pad)
                start = line.cell_len
                line.append("▏", Style(dim=True))
                line.append(display, key_style)
                line.append(f" {description} ", text_style)
                self._spans.append((start, line.cell_len, self._palette))
        return line

    def on_resize(self, event: events.Resize) -> None:
        self.refresh()  # the palette key stays on the right edge

    def on_mouse_down(self, event: events.MouseDown) -> None:
        for start, end, (key, _, _, enabled) in self._spans:
            if start <= event.x < end:
                event.stop()
                if enabled:
                    self.app.simulate_key(key)
                else:
                    self.app.bell()
                return
