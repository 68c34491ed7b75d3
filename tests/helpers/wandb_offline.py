"""Read a W&B offline run back from its ``.wandb`` transaction log, with W&B's own protobuf types.

wandb 0.19+ writes the log from its Go core and no longer ships the Python reader
(``wandb.sdk.internal.datastore``); the container is a LevelDB-style log: a 7-byte header
(``:W&B``, magic, version), then 32 KiB blocks of records, each ``crc32c(4) length(2) type(1)``
(1 full, 2 first, 3 middle, 4 last), zero padding where a block has under 7 bytes left.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Iterator

_BLOCK = 32768


def _chunks(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # padding up to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def history(run_dir: Path, wait_s: float = 30.0) -> list[dict]:
    """Every history row of the offline run in ``run_dir`` (``offline-run-*``), values decoded.

    ``run.finish()`` can return before W&B's core process has written the log's last records:
    wait (up to ``wait_s``) for its ``exit`` record."""
    from wandb.proto import wandb_internal_pb2 as pb
    deadline = time.monotonic() + wait_s
    while True:
        (log,) = run_dir.glob("run-*.wandb")
        records = []
        for raw in _chunks(log.read_bytes()):
            record = pb.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
