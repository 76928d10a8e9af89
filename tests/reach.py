"""How often a property test reaches the cases it exists for.

A property over random records proves little if nearly every example is refused at the
first check: ``Reach`` counts, per example, the branches a test cares about (each also a
``hypothesis.event``, shown by ``pytest --hypothesis-show-statistics``), and the test asserts
each rate above a floor once hypothesis is done. ``pytest -s`` prints the rates
(``reach <test>: <branch> <hits>/<examples> (<percent>)``)."""

from __future__ import annotations

from collections import Counter

from hypothesis import event


class Reach:
    def __init__(self, name: str) -> None:
        self.name = name
        self.examples = 0
        self.hits: Counter[str] = Counter()

    def example(self) -> None:
        """Call once at the top of each example."""
        self.examples += 1

    def hit(self, branch: str, reached: object = True) -> None:
        """Count ``branch`` for this example if ``reached`` is truthy."""
        if reached:
            self.hits[branch] += 1
            event(branch)

    def rate(self, branch: str) -> float:
        return self.hits[branch] / self.examples if self.examples else 0.0

    def report(self) -> str:
        return "\n".join(f"reach {self.name}: {b} {self.hits[b]}/{self.examples} "
                         f"({self.rate(b):.0%})" for b in sorted(self.hits)) or (
            f"reach {self.name}: nothing reached in {self.examples} examples")

    def check(self, **floors: float) -> None:
        """Print the rates; fail for any branch reached less often than its floor (a
        fraction of the examples)."""
        print(self.report())
        low = [f"{b} {self.hits[b]}/{self.examples} < {floor:.0%}"
               for b, floor in floors.items() if self.rate(b) < floor]
        assert not low, f"{self.name}: interesting branches too rarely reached: {low}"
