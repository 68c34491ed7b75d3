"""Kept for imports of the old name: the recorder lives in :mod:`ampwatch.record`."""
from .record.watch import Watch, _open_watches, log  # noqa: F401
