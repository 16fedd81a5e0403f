"""A GGUF file's metadata and tensor table, read in a fraction of a second.

ggml's own `gguf.GGUFReader` builds a numpy view for every part of every field: a Llama 3 file's
tokenizer (128k tokens, their types and scores, 280k merges) is over a million views, 6-7 s of CPU
in each process that opens the file (gateway, prefill and decode workers), 40 s on a loaded 2-core
machine. This reader walks the header with `struct` over the mapped bytes, keeps each array as where
it lies, and decodes one only when asked (`Field.contents()`). Tensors are the same views of the
map as ggml's reader gives (`data`: [*dims reversed] for float and integer types, [rows, bytes a
row] blocks for quantized ones), so engine/gguf_weights.py reads either alike.
Little-endian files only (what llama.cpp writes; a big-endian one is refused by name).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_MAGIC = 0x46554747  # b"GGUF" read as little-endian uint32
_VERSIONS = (2, 3)
T = gguf.GGUFValueType
_SCALARS = {  # value type -> (struct format, numpy dtype)
    T.UINT8: ("<B", np.uint8),
    T.INT8: ("<b", np.int8),
    T.UINT16: ("<H", np.uint16),
    T.INT16: ("<h", np.int16),
    T.UINT32: ("<I", np.uint32),
    T.INT32: ("<i", np.int32),
    T.FLOAT32: ("<f", np.float32),
    T.BOOL: ("<?", np.bool_),
    T.UINT64: ("<Q", np.uint64),
    T.INT64: ("<q", np.int64),
    T.FLOAT64: ("<d", np.float64),
}
_PLAIN_DTYPES = {  # tensor types whose data is an array of one numpy dtype (others: bytes of blocks)
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GgufFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    """One metadata value where it lies: a scalar, a string, or an array of either."""

    buf: Any  # the mapped file
    type: gguf.GGUFValueType
    offset: int  # of the value (an array: of its element type)
    count: int = 1  # array elements (scalars and strings: 1)
    item_type: gguf.GGUFValueType | None = None  # an array's element type

    def contents(self) -> Any:
        if self.type != T.ARRAY:
            return _scalar(self.buf, self.type, self.offset)[0]
        assert self.item_type is not None
        if self.item_type == T.STRING:
            out, off = [], self.offset
            for _ in range(self.count):
                s, off = _string(self.buf, off)
                out.append(s)
            return out
        if self.item_type == T.ARRAY:
            raise GgufFormatError("nested GGUF arrays are not read")
        fmt, dtype = _SCALARS[self.item_type]
        return np.frombuffer(self.buf, dtype=dtype, count=self.count, offset=self.offset).tolist()


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # dims as GGUF stores them, innermost first
    data: np.ndarray  # a view of the map (see the module docstring)


def _string(buf: Any, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    end = off + 8 + n
    return bytes(buf[off + 8 : end]).decode("utf-8"), end


def _scalar(buf: Any, vtype: gguf.GGUFValueType, off: int) -> tuple[Any, int]:
    if vtype == T.STRING:
        return _string(buf, off)
    fmt, _ = _SCALARS[vtype]
    return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)


def _skip_array(buf: Any, item: gguf.GGUFValueType, count: int, off: int) -> int:
    """The offset past `count` elements of type `item` from `off`."""
    if item == T.STRING:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, off)
            off += 8 + n
        return off
    if item == T.ARRAY:
        for _ in range(count):
            inner, n = struct.unpack_from("<IQ", buf, off)
            off = _skip_array(buf, T(inner), n, off + 12)
        return off
    return off + struct.calcsize(_SCALARS[item][0]) * count


class GgufFile:
    """`fields` (key -> Field) and `tensors` (in the file's order) of one GGUF file, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != _MAGIC:
            raise GgufFormatError(f"{path}: not a GGUF file")
        if version not in _VERSIONS:
            big = version & 0xFFFF == 0
            raise GgufFormatError(
                f"{path}: " + ("a big-endian GGUF file is not read" if big else f"GGUF version {version} is not read")
            )
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, off = _string(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            vt = T(vtype)
            if vt == T.ARRAY:
                item, count = struct.unpack_from("<IQ", buf, off)
                off += 12
                self.fields[key] = Field(buf, vt, off, count, T(item))
                off = _skip_array(buf, T(item), count, off)
            else:
                self.fields[key] = Field(buf, vt, off)
                off = _scalar(buf, vt, off)[1]
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = np.frombuffer(buf, dtype=np.uint64, count=n_dims, offset=off + 4).astype(np.int64)
            off += 4 + 8 * n_dims
            ttype, data_off = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, gguf.GGMLQuantizationType(ttype), dims, data_off))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.contents()) if align_field is not None else gguf.GGUF_DEFAULT_ALIGNMENT
        if align <= 0 or align & (align - 1):
            raise GgufFormatError(f"{path}: alignment {align} is not a power of two")
        start = off + (-off % align)
        array = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[Tensor] = []
        for name, ttype, dims, data_off in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[ttype]
            n_elems = int(np.prod(dims))
            n_bytes = n_elems * type_size // block
            raw = array[start + data_off : start + data_off + n_bytes]
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            if ttype in _PLAIN_DTYPES:
                data = raw.view(_PLAIN_DTYPES[ttype]).reshape(np_dims)
            else:
                data = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, ttype))
            self.tensors.append(Tensor(name, ttype, dims, data))
