"""TensorBoard: event files in a log folder, or the calls of a writer the user already has.

A folder gets event files written with the ``tensorboard`` package's own writer (no torch, one
event per step with every scalar of the step in it; the extra ``tensorboard``). A writer object
(``torch.utils.tensorboard.SummaryWriter``, tensorboardX's) gets ``add_scalar`` and ``add_text``
calls, so its own files, flushing and tags rules apply (torch's ``add_text`` appends
``/text_summary`` to the tag).
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

from .series import Point


def is_writer(obj: Any) -> bool:
    """An object with SummaryWriter's ``add_scalar``: mirrored through its own calls."""
    return callable(getattr(obj, "add_scalar", None))


class TensorBoardSink:
    """Points and texts into TensorBoard.

    :param target: a log folder (created if missing) or a SummaryWriter-like object. A writer we
        did not create is flushed, never closed, when the sink closes.
    """

    def __init__(self, target: Any) -> None:
        if is_writer(target):
            self._writer: Any = target
            self._own = False
        else:
            self._writer = _EventWriter(os.fspath(target))
            self._own = True

    @property
    def where(self) -> str:
        get = getattr(self._writer, "get_logdir", None)
        return str(get()) if callable(get) else type(self._writer).__name__

    def scalars(self, points: list[Point]) -> None:
        if self._own:
            for p in points:
                self._writer.scalars(p.step, p.wall_time, p.values)
            return
        add = self._writer.add_scalar
        for p in points:
            for tag, value in p.values.items():
                add(tag, value, p.step, walltime=p.wall_time)

    def texts(self, tag: str, items: list[tuple[int, str]]) -> None:
        for step, text in items:
            if self._own:
                self._writer.text(tag, step, text)
            else:
                self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._own:
            self._writer.close()
        else:
            self._writer.flush()


class _EventWriter:
    """The tensorboard package's event file writer with the two summaries we need."""

    def __init__(self, logdir: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        os.makedirs(logdir, exist_ok=True)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._tensor, self._shape = tensor_pb2.TensorProto, tensor_shape_pb2.TensorShapeProto
        # the text plugin finds texts by this metadata; the same bytes torch's add_text writes
        content = plugin_data_pb2.TextPluginData(version=0).SerializeToString()
        self._text_meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text", content=content))
        # max_queue_size: events wait in memory until the writer's own thread writes them; a large
        # queue lets an export hand over a whole chunk without blocking on each event.
        self._file = EventFileWriter(logdir, max_queue_size=1000, flush_secs=10)

    def get_logdir(self) -> str:
        return self._file.get_logdir()

    def scalars(self, step: int, wall_time: Optional[float], values: dict[str, float]) -> None:
        Value = self._summary.Value
        summary = self._summary(value=[Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self._file.add_event(self._event(step=step, wall_time=wall_time or time.time(), summary=summary))

    def text(self, tag: str, step: int, text: str) -> None:
        tensor = self._tensor(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                              tensor_shape=self._shape(dim=[self._shape.Dim(size=1)]))
        summary = self._summary(value=[self._summary.Value(tag=tag, metadata=self._text_meta, tensor=tensor)])
        self._file.add_event(self._event(step=step, wall_time=time.time(), summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
