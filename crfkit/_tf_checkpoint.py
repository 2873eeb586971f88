"""Read float tensors out of a TensorFlow "V2" checkpoint (model.ckpt.index + .data-*) without
TensorFlow, which is a dependency of half a gigabyte for what is a table of offsets.

    names = checkpoint_variables("model.ckpt")           # {name: (dtype code, shape)}
    table = read_checkpoint_tensor("model.ckpt", "token_embedding/token_embedding_weights")

The index is a LevelDB-format table (an SSTable): data blocks of prefix-compressed key / value
entries, an index block pointing at them and a 48-byte footer. Each value is a serialised
BundleEntryProto (dtype, shape, shard, offset and size of the tensor's bytes in the data shard);
the key "" holds the bundle's header. Only what a checkpoint written by tf.train.Saver holds is
read: uncompressed blocks, unsliced float32 tensors in little-endian order. Anything else is a
ValueError naming the file, not a wrong answer.
"""
from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["checkpoint_variables", "read_checkpoint_tensor"]

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_BYTES = 48
_DT_FLOAT = 1


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _protobuf_fields(data: bytes) -> list[tuple[int, object]]:
    """(field number, value) of a serialised protobuf message: ints for varint / fixed fields,
    bytes for length-delimited ones (wire types 0, 1, 2, 5)."""
    fields, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: object
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", data, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = struct.unpack_from("<I", data, pos)[0], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, value))
    return fields


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """The (key, value) entries of one SSTable block (keys stored as shared-prefix deltas)."""
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * restarts
    entries, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        size, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        entries.append((key, block[pos:pos + size]))
        pos += size
    return entries


def _read_block(data: bytes, handle: bytes) -> bytes:
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    if offset + size + 5 > len(data):
        raise ValueError("a block handle points past the end of the file")
    if data[offset + size] != 0:
        raise ValueError("compressed blocks are not supported")
    return data[offset:offset + size]


def _entries(prefix: str) -> dict[str, dict]:
    path = prefix + ".index"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise ValueError(f"cannot read the checkpoint index {path}: {error}") from None
    try:
        if len(data) < _FOOTER_BYTES or struct.unpack_from("<Q", data, len(data) - 8)[0] != _TABLE_MAGIC:
            raise ValueError("not a LevelDB-format table (bad magic number)")
        footer = data[len(data) - _FOOTER_BYTES:]
        _, pos = _varint(footer, 0)          # the metaindex block's handle (unused)
        _, pos = _varint(footer, pos)
        index_handle = footer[pos:]
        out = {}
        for _, block_handle in _block_entries(_read_block(data, index_handle)):
            for key, value in _block_entries(_read_block(data, block_handle)):
                if not key:              # the bundle header
                    continue
                fields = dict(_protobuf_fields(value))
                dims = [dict(_protobuf_fields(dim)).get(1, 0)
                        for number, dim in _protobuf_fields(fields.get(2, b"")) if number == 2]
                if 7 in fields:
                    raise ValueError(f"variable {key!r} is stored in slices, which is not supported")
                out[key.decode("utf-8")] = {"dtype": fields.get(1, 0), "shape": tuple(int(d) for d in dims),
                                            "shard": fields.get(3, 0), "offset": fields.get(4, 0),
                                            "size": fields.get(5, 0)}
        return out
    except (ValueError, struct.error, IndexError) as error:
        raise ValueError(f"{path} is not a TensorFlow V2 checkpoint index that can be read here: {error}") from None


def checkpoint_variables(prefix: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{variable name: (TensorFlow dtype code, shape)} of the checkpoint prefix (the path
    without .index, e.g. "model.ckpt")."""
    return {name: (entry["dtype"], entry["shape"]) for name, entry in _entries(prefix).items()}


def read_checkpoint_tensor(prefix: str, name: str) -> np.ndarray:
    """The float32 tensor `name` of the checkpoint prefix, as a numpy array of its shape."""
    entries = _entries(prefix)
    if name not in entries:
        raise ValueError(f"{prefix}.index has no variable {name!r}; it has {sorted(entries)}")
    entry = entries[name]
    if entry["dtype"] != _DT_FLOAT:
        raise ValueError(f"{name!r} in {prefix} has TensorFlow dtype {entry['dtype']}, not float32 (1)")
    count = int(np.prod(entry["shape"], dtype=np.int64))
    if entry["size"] != 4 * count:
        raise ValueError(f"{name!r} in {prefix}: {entry['size']} bytes for shape {entry['shape']}")
    shards = [f for f in os.listdir(os.path.dirname(prefix) or ".")
              if f.startswith(os.path.basename(prefix) + ".data-")]
    shard = f"{prefix}.data-{entry['shard']:05d}-of-{len(shards):05d}"
    try:
        with open(shard, "rb") as f:
            f.seek(entry["offset"])
            raw = f.read(entry["size"])
    except OSError as error:
        raise ValueError(f"cannot read {shard}: {error}") from None
    if len(raw) != entry["size"]:
        raise ValueError(f"{shard} ends before {name!r} does")
    return np.frombuffer(raw, dtype="<f4").reshape(entry["shape"]).astype(np.float32)
