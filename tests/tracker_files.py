"""Reading experiment-tracker output back, for the tests: TensorBoard event
files (tensorboard's own reader) and a W&B offline run's ``.wandb`` file
(a LevelDB-style record log of W&B protobuf records; wandb no longer ships
a Python reader for it)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768  # the log is written in blocks; a record header never straddles one
HEADER = 7  # crc32 (4), length (2), type (1); the file starts with a 7-byte header too
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] over the event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(path: Path):
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic, version)
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero-filled tail of a block still being written
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            yield parts + body
            parts = b""


def wandb_history(run_dir: Path, want: int = 0, timeout_s: float = 30.0, having: str | None = None) -> list[dict]:
    """The history rows (``run.log`` calls) of the W&B offline run(s) under
    ``run_dir`` (…/wandb/offline-run-*/run-*.wandb), in order; only the rows
    that hold the key ``having`` when it is given. wandb's core process
    writes the file lazily (after ``run.finish()`` returns, or whenever it
    gets to it on a loaded box): wait up to ``timeout_s`` for at least
    ``want`` such rows."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for r in _history(run_dir) if having is None or having in r]
        if len(rows) >= want or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _history(run_dir: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for raw in _records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows
