"""A GGUF file's metadata values and tensor directory, read straight from its header.

`gguf.GGUFReader` builds a numpy view for every element of every array, seconds for a tokenizer's
50,000 strings (SmolLM2) and more for Llama 3's 128,000 tokens and 280,000 merges; the config
needs none of them. Here string arrays are stepped over (their length is kept), numeric arrays and
scalars are read as Python values, and a tensor's values are read on demand. The layout (GGUF v2/v3,
little-endian): magic, version u32, tensor count u64, key count u64; each key a string (u64 length,
bytes), a u32 value type and the value (arrays: element type u32, count u64, elements); each
tensor's name, dimension count u32, dimensions u64 (innermost first), ggml type u32, data offset u64;
the data after the header, aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_TENSORS = {0: np.float32, 1: np.float16}  # ggml types F32, F16


class GGUFHeaderError(ValueError):
    """The file is not a GGUF this reader understands (named)."""


@dataclass(frozen=True, slots=True)
class StringArray:
    """A string array's place in the metadata (its strings are not read)."""

    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's directory entry: shape outermost first (as torch holds it), ggml type id, offset."""

    shape: tuple[int, ...]
    type_id: int
    offset: int


class GGUFHeader:
    """`fields` (key -> value: int, float, bool, str, list of numbers, or `StringArray`) and `tensors`
    (name -> TensorInfo) of the GGUF at `path`; GGUFHeaderError for a file it cannot read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    self._parse(data)
            except (struct.error, UnicodeDecodeError, KeyError, ValueError) as exc:  # ValueError: an empty file
                if isinstance(exc, GGUFHeaderError):
                    raise
                raise GGUFHeaderError(f"{str(path)!r} is not a readable GGUF file ({exc!r})") from None

    def _parse(self, data: mmap.mmap) -> None:
        if data[:4] != b"GGUF":
            raise GGUFHeaderError(f"{str(self.path)!r} does not start with the GGUF magic")
        version, tensors, keys = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise GGUFHeaderError(f"{str(self.path)!r} is GGUF version {version}; 2 and 3 are read")
        self.pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(keys):
            key = self._string(data)
            (kind,) = struct.unpack_from("<I", data, self.pos)
            self.pos += 4
            self.fields[key] = self._value(data, kind)
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(tensors):
            name = self._string(data)
            (dims,) = struct.unpack_from("<I", data, self.pos)
            shape = struct.unpack_from(f"<{dims}Q", data, self.pos + 4)
            type_id, offset = struct.unpack_from("<IQ", data, self.pos + 4 + 8 * dims)
            self.pos += 4 + 8 * dims + 12
            self.tensors[name] = TensorInfo(tuple(int(s) for s in reversed(shape)), int(type_id), int(offset))
        alignment = int(self.fields.get("general.alignment", 32))
        self.data_offset = -(-self.pos // alignment) * alignment

    def _string(self, data: mmap.mmap) -> str:
        (length,) = struct.unpack_from("<Q", data, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return data[start : self.pos].decode()

    def _value(self, data: mmap.mmap, kind: int) -> Any:
        if kind == _STRING:
            return self._string(data)
        if kind == _ARRAY:
            element, count = struct.unpack_from("<IQ", data, self.pos)
            self.pos += 12
            if element == _STRING:
                for _ in range(count):  # stepped over: u64 length, then the bytes
                    self.pos += 8 + struct.unpack_from("<Q", data, self.pos)[0]
                return StringArray(int(count))
            if element == _ARRAY:
                return [self._value(data, _ARRAY) for _ in range(count)]
            values = np.frombuffer(data, dtype=_NUMPY[element], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def float_tensor(self, name: str) -> list[float] | None:
        """The values of an F32 / F16 tensor, None when the file has no tensor of that name;
        GGUFHeaderError for another type."""
        info = self.tensors.get(name)
        if info is None:
            return None
        dtype = _FLOAT_TENSORS.get(info.type_id)
        if dtype is None:
            raise GGUFHeaderError(f"GGUF tensor {name!r} has ggml type {info.type_id}; F32 or F16 expected")
        count = int(np.prod(info.shape))
        with self.path.open("rb") as f:
            f.seek(self.data_offset + info.offset)
            raw = f.read(count * np.dtype(dtype).itemsize)
        return [float(v) for v in np.frombuffer(raw, dtype=dtype)]
