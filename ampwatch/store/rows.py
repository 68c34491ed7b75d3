"""The rows of one flush, by table, as plain tuples: what the recorder hands the writer.

The writer inserts them in the column order of its INSERT statements (:mod:`.writer`); it never
sees a tensor, so the run file can be written and tested without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TABLES = ("steps", "layers", "modules", "events", "metrics", "fp8_layers", "memory", "batches")


@dataclass
class Rows:
    steps: list[tuple] = field(default_factory=list)
    layers: list[tuple] = field(default_factory=list)
    modules: list[tuple] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    metrics: list[tuple] = field(default_factory=list)
    fp8_layers: list[tuple] = field(default_factory=list)
    memory: list[tuple] = field(default_factory=list)
    batches: list[tuple] = field(default_factory=list)

    def extend(self, other: "Rows") -> None:
        for name in TABLES:
            getattr(self, name).extend(getattr(other, name))

    def count(self) -> int:
        return sum(len(getattr(self, n)) for n in TABLES)
