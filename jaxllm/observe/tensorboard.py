"""TensorBoard event files without TensorFlow: scalars written through tensorboardX, and read back.

tensorboardX ships a writer but no reader (TensorBoard's own EventAccumulator needs the `tensorboard` package);
the reader here parses the TFRecord framing (length, masked CRC-32C, Event protobuf, masked CRC-32C) with
tensorboardX's own protobuf classes and CRC, about twenty lines.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from jaxllm.observe.metrics import scalar_fields

FLUSH_SECS = 10  # how stale a live TensorBoard may be; close() flushes everything


def _tensorboardx():
    """The tensorboardX package, imported without torch.

    tensorboardX's package `__init__` imports torch whenever it is installed, only to accept torch tensors:
    2.4 s of every training process's start-up on a 2-core machine, for nothing (jaxllm logs Python floats).
    A None entry in sys.modules makes `import torch` raise ImportError, which tensorboardX handles; the entry is
    removed again at once, so a later `import torch` works normally.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


class TensorBoardWriter:
    """Every scalar field of each record as a TensorBoard scalar (tag = the key, global step = record["step"])."""

    def __init__(self, logdir: str | Path):
        self.writer = _tensorboardx().SummaryWriter(str(logdir), flush_secs=FLUSH_SECS)

    def write(self, record: dict) -> None:
        if "step" not in record:
            return
        for tag, value in scalar_fields(record).items():
            self.writer.add_scalar(tag, value, global_step=int(record["step"]))

    def close(self) -> None:
        self.writer.close()


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in the event files of `logdir`: tag -> [(step, value), ...] in file and write order (values
    are float32, as TensorBoard stores them)."""
    _tensorboardx()
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for body in _records(path):
            event = Event.FromString(body)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _records(path: Path):
    """The record bodies of one TFRecord file, CRCs checked (a damaged record raises ValueError naming the file);
    an incomplete last record (a file still being written) ends the file."""
    from tensorboardX.record_writer import masked_crc32c

    data, offset = path.read_bytes(), 0
    while offset + 12 <= len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        end = offset + 16 + length
        if end > len(data):
            return
        (header_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        body = data[offset + 12:end - 4]
        (body_crc,) = struct.unpack("<I", data[end - 4:end])
        if header_crc != masked_crc32c(header) or body_crc != masked_crc32c(body):
            raise ValueError(f"{path}: damaged record at byte {offset}")
        yield body
        offset = end
