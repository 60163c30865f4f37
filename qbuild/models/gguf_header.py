"""A GGUF file is untrusted input: its header is walked here, bounded, before gguf-py (or anything else) parses it.

gguf-py's reader trusts every count and length in the file: an array declaring 2^40 elements past the end of the
file makes it loop reading nothing and grow without bound, and a tensor past the end, an alignment of 0 or a
dimension that overflows raise deep inside it. This walk reads the header with `struct` from a memory map, checks
every count, length and offset against the bytes that are really there and against the rules llama.cpp's own
loader (ggml's gguf.cpp) enforces, and gives up past a time bound. Nothing is allocated by a size the file states.
What passes is a file gguf-py parses in time and memory proportional to its header.
"""

from __future__ import annotations

import mmap
import re
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)               # what gguf-py's reader (and llama.cpp) read
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63            # GGML_MAX_NAME - 1: llama.cpp refuses longer names
MAX_KEY = 65_535
MAX_STRING = 64 << 20           # one metadata string (a chat template is tens of KB)
MAX_ELEMENTS = 1 << 50          # one tensor; far above any model, far below an int64 overflow
MAX_ARRAY_DEPTH = 2             # an array of arrays at most (llama.cpp writes none)
DEFAULT_ALIGNMENT = 32
TIME_LIMIT_S = 20.0

# GGUF metadata value types: fixed-size scalars (struct code), then STRING = 8, ARRAY = 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
_BLOCK = re.compile(r"blk\.(\d+)\.")


class GGUFRefused(ValueError):
    """The file breaks a rule of the format or a bound: the message names the field (one line)."""


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensors: int
    metadata: int
    elements: int           # parameters in the file: the sum of its tensors' elements
    blocks: int             # 1 + the highest `blk.N.` index among its tensors (0: none)
    data_bytes: int         # the tensor data, as the header lays it out
    matrix_types: frozenset[str] = frozenset()   # the ggml types of its 2-D and larger tensors (F16, Q4_K, ...)
    values: dict = None     # the metadata values asked for (check_gguf's `keys`): scalars, strings, scalar arrays


def check_gguf(path: Path, time_limit_s: float = TIME_LIMIT_S, keys: tuple[str, ...] = (),
               arch_keys: tuple[str, ...] = ()) -> GGUFHeader:
    """Walk `path`'s header and tensor table; raise GGUFRefused naming what is wrong. `keys`: metadata whose values
    to return in `values` (absent keys are left out; an array comes back as a list when its elements are scalars).
    `arch_keys`: names under the file's own architecture (`block_count` for `llama.block_count` in a llama file),
    returned under their full keys beside `general.architecture`: one walk, whichever order the file keeps."""
    with open(path, "rb") as f:
        size = _file_size(f)
        if size < 24:
            raise GGUFRefused(f"{size} bytes: too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Walk(data, size, time.monotonic() + time_limit_s, keys, arch_keys).header()


def metadata_values(path: Path, keys: tuple[str, ...] = (), arch_keys: tuple[str, ...] = ()) -> dict:
    """The values of `keys` (and of `arch_keys` under the file's architecture, as check_gguf) in a GGUF file's
    metadata, read by the bounded walk: what gguf-py's GGUFReader would give for them, without decoding every field
    of the file (its vocabulary alone is 2 s for a 49k-token one)."""
    return check_gguf(path, keys=keys, arch_keys=arch_keys).values


def _file_size(f) -> int:
    import os

    return os.fstat(f.fileno()).st_size


class _Walk:
    def __init__(self, data, size: int, deadline: float, keys: tuple[str, ...] = (), arch_keys: tuple[str, ...] = ()):
        self.data, self.size, self.deadline, self.pos, self.ticks = data, size, deadline, 0, 0
        self.order = "<"
        self.wanted, self.values = {k.encode() for k in keys}, {}
        # `<prefix>.<name>` values for every prefix, kept until the walk knows the architecture (at most one per key
        # of the file, whose count the walk has bounded)
        self.arch_names, self.under_prefix = {k.encode() for k in arch_keys}, {}
        if arch_keys:
            self.wanted.add(b"general.architecture")

    # --- primitive reads, each checked against the end of the file -------------------------------------------------
    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFRefused(f"{what}: needs {n:,} bytes at offset {self.pos:,}, past the end of the file "
                              f"({self.size:,} bytes)")

    def scalar(self, code: str, what: str):
        n = struct.calcsize(code)
        self.need(n, what)
        (value,) = struct.unpack_from(self.order + code, self.data, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int) -> bytes:
        length = self.scalar("Q", f"{what} length")
        if length > limit:
            raise GGUFRefused(f"{what}: a string of {length:,} bytes, over the limit of {limit:,}")
        self.need(length, what)
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        return raw

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks & 0xFFF == 0 and time.monotonic() > self.deadline:
            raise GGUFRefused(f"the header took over {TIME_LIMIT_S:g} s to read (at offset {self.pos:,})")

    # --- the format -----------------------------------------------------------------------------------------------
    def header(self) -> GGUFHeader:
        if self.data[:4] != MAGIC:
            raise GGUFRefused("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.scalar("I", "version")
        if version not in VERSIONS and version & 0xFFFF == 0:   # a big-endian file: gguf-py reads those too
            self.order, self.pos = ">", 4
            version = self.scalar("I", "version")
        if version not in VERSIONS:
            raise GGUFRefused(f"version {version} is not a GGUF version gguf-py reads ({', '.join(map(str, VERSIONS))})")
        n_tensors = self.scalar("Q", "tensor_count")
        n_kv = self.scalar("Q", "metadata_kv_count")
        # the smallest metadata pair is 13 bytes (a 1-byte key and a 1-byte value), the smallest tensor entry 33
        if n_kv * 13 > self.size - self.pos:
            raise GGUFRefused(f"metadata_kv_count {n_kv:,} cannot fit in a file of {self.size:,} bytes")
        if n_tensors * 33 > self.size - self.pos:
            raise GGUFRefused(f"tensor_count {n_tensors:,} cannot fit in a file of {self.size:,} bytes")
        alignment = DEFAULT_ALIGNMENT
        keys: set[bytes] = set()
        for _ in range(n_kv):
            self.tick()
            key = self.string("metadata key", MAX_KEY)
            if key in keys:
                raise GGUFRefused(f"metadata key {_shown(key)} appears twice")
            keys.add(key)
            kind = self.scalar("I", f"{_shown(key)} type")
            if key == b"general.alignment":
                if kind != 4:
                    raise GGUFRefused("general.alignment: not a uint32")
                alignment = self.scalar("I", "general.alignment")
                if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                    raise GGUFRefused(f"general.alignment: {alignment} is not a power of two up to 1 MiB")
                continue
            start = self.pos
            self.value(kind, _shown(key), depth=0)
            if key in self.wanted:
                self.values[key.decode()] = self.decoded(kind, start)
            elif self.arch_names and key.partition(b".")[2] in self.arch_names:
                self.under_prefix[key] = (kind, start)
        header = self.tensor_table(n_tensors, alignment, version, n_kv)
        arch = self.values.get("general.architecture")
        if isinstance(arch, str):
            for name in self.arch_names:
                found = self.under_prefix.get(arch.encode() + b"." + name)
                if found is not None:
                    self.values[f"{arch}.{name.decode()}"] = self.decoded(*found)
        return replace(header, values=self.values)

    def decoded(self, kind: int, start: int):
        """The value the walk just checked, read again from `start` (its bounds already hold)."""
        end, self.pos = self.pos, start
        try:
            if kind in _SCALARS:
                return self.scalar(_SCALARS[kind], "value")
            if kind == STRING:
                return self.string("value", MAX_STRING).decode("utf-8", "replace")
            item = self.scalar("I", "element type")
            count = self.scalar("Q", "element count")
            if item not in _SCALARS:
                return None   # arrays of strings or arrays: not asked for by qbuild
            return list(struct.unpack_from(f"{self.order}{count}{_SCALARS[item]}", self.data, self.pos))
        finally:
            self.pos = end

    def value(self, kind: int, what: str, depth: int) -> None:
        if kind in _SCALARS:
            self.scalar(_SCALARS[kind], what)
        elif kind == STRING:
            self.string(what, MAX_STRING)
        elif kind == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFRefused(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            item = self.scalar("I", f"{what} element type")
            count = self.scalar("Q", f"{what} element count")
            if item in _SCALARS:   # fixed-size elements: checked and skipped without a loop
                n = count * struct.calcsize(_SCALARS[item])
                self.need(n, f"{what} ({count:,} elements)")
                self.pos += n
                return
            # a string is at least its 8-byte length, an array its 12-byte type and count
            if count * (8 if item == STRING else 12) > self.size - self.pos:
                raise GGUFRefused(f"{what}: {count:,} elements cannot fit in the {self.size - self.pos:,} bytes left")
            for _ in range(count):
                self.tick()
                self.value(item, what, depth + 1)
        else:
            raise GGUFRefused(f"{what}: unknown value type {kind}")

    def tensor_table(self, n_tensors: int, alignment: int, version: int, n_kv: int) -> GGUFHeader:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        names: set[bytes] = set()
        entries = []
        elements = blocks = 0
        matrix_types: set[str] = set()
        for _ in range(n_tensors):
            self.tick()
            raw = self.string("tensor name", MAX_KEY)
            name = _shown(raw)
            if len(raw) > MAX_TENSOR_NAME:
                raise GGUFRefused(f"tensor {name}: a name of {len(raw)} bytes (llama.cpp allows {MAX_TENSOR_NAME})")
            if raw in names:
                raise GGUFRefused(f"tensor {name} appears twice")
            names.add(raw)
            n_dims = self.scalar("I", f"tensor {name} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFRefused(f"tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            dims = [self.scalar("Q", f"tensor {name} dimension") for _ in range(n_dims)]
            count = 1
            for d in dims:
                if d == 0 or d > MAX_ELEMENTS:
                    raise GGUFRefused(f"tensor {name}: dimension {d:,} out of range")
                count *= d
                if count > MAX_ELEMENTS:
                    raise GGUFRefused(f"tensor {name}: dimensions {dims} overflow ({count:,} elements)")
            kind = self.scalar("I", f"tensor {name} type")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise GGUFRefused(f"tensor {name}: unknown ggml type {kind}") from None
            if n_dims >= 2:
                matrix_types.add(GGMLQuantizationType(kind).name)
            if dims[0] % block:
                raise GGUFRefused(f"tensor {name}: a row of {dims[0]} is not a whole number of {block}-element blocks")
            offset = self.scalar("Q", f"tensor {name} offset")
            entries.append((name, offset, count // block * type_size))
            elements += count
            found = _BLOCK.match(raw.decode("utf-8", "replace"))
            if found:
                blocks = max(blocks, int(found.group(1)) + 1)
        start = -(-self.pos // alignment) * alignment
        expected = 0
        for name, offset, nbytes in entries:   # llama.cpp's rule: each tensor right after the one before, aligned
            if offset != expected:
                raise GGUFRefused(f"tensor {name}: data offset {offset:,}, expected {expected:,}")
            if start + offset + nbytes > self.size:
                raise GGUFRefused(f"tensor {name}: its {nbytes:,} bytes end past the end of the file "
                                  f"({start + offset + nbytes:,} > {self.size:,})")
            expected = -(-(offset + nbytes) // alignment) * alignment
        return GGUFHeader(version, n_tensors, n_kv, elements, blocks, expected, frozenset(matrix_types))


def _shown(raw: bytes, limit: int = 60) -> str:
    text = raw.decode("utf-8", "replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
