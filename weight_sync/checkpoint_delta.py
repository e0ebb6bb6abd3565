"""One published delta version applied, in place, to a host-local safetensors checkpoint.

slime's disk-delta weight sync (`--update-weight-local-checkpoint-dir`) publishes each sync as
`weight_vNNNNNN/` under a shared folder: an HF-style `model.safetensors.index.json` whose metadata
names the version, the version it builds on (`base_version`), the encoding (`delta_encoding`:
"xor" or "overwrite"), `compression_format` ("zstd") and `checksum_format` ("xxh3-128", "blake3"
or "adler32"); and safetensors files holding, per changed tensor, a uint8 array of its compressed
delta, with the checksum of the tensor's new bytes in the file's `__metadata__`.

  xor        the new bytes XOR the old ones, the same length as the tensor
  overwrite  u32 count, u32 byte positions, then the new byte at each position

The tensors are patched where they lie in the local files (a memory map per file), each in its own
thread (decompression and checksums release the GIL), and every one is checked against its
checksum; any problem raises, naming it. Tandem reads nothing of this format elsewhere.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

INDEX = "model.safetensors.index.json"
WORKERS = min(16, os.cpu_count() or 4)
XOR_CHUNK = 8 << 20


def delta_metadata(version_dir: str) -> dict | None:
    """The index metadata of a delta version; None for a full checkpoint (no index, or an index
    without `delta_encoding`). A missing folder raises: the publisher has not written it (yet)."""
    if not os.path.isdir(version_dir):
        raise FileNotFoundError(f"published weight version {version_dir} does not exist")
    try:
        with open(os.path.join(version_dir, INDEX)) as f:
            meta = json.load(f).get("metadata") or {}
    except FileNotFoundError:
        return None
    return meta if "delta_encoding" in meta else None


def safetensors_header(path: str) -> tuple[dict, int]:
    """(the header's JSON, where the data begins) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def tensor_spans(ckpt_dir: str) -> dict[str, tuple[str, int, int]]:
    """name -> (file, first byte, byte count) of every tensor of a checkpoint folder."""
    spans = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            path = os.path.join(ckpt_dir, name)
            header, data = safetensors_header(path)
            for tensor, info in header.items():
                if tensor != "__metadata__":
                    begin, end = info["data_offsets"]
                    spans[tensor] = (path, data + begin, end - begin)
    return spans


class _Adler32:
    def __init__(self) -> None:
        self.value = 1

    def update(self, data: Any) -> None:
        self.value = zlib.adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hasher(algorithm: str) -> Any:
    """A fresh incremental hash object of a `checksum_format`."""
    if algorithm == "adler32":
        return _Adler32()
    module = {"xxh3-128": "xxhash", "blake3": "blake3"}.get(algorithm)
    if module is None:
        raise ValueError(f"checksum_format {algorithm!r} is not supported (xxh3-128, blake3 or adler32)")
    try:
        lib = __import__(module)
    except ImportError:
        raise RuntimeError(f"checksum_format {algorithm!r} needs the {module} package: pip install {module}") from None
    return lib.xxh3_128() if module == "xxhash" else lib.blake3()


@dataclass
class _Patch:
    name: str
    source: tuple[str, int, int]  # the delta file, where the tensor's compressed delta begins, its bytes
    region: np.ndarray  # the tensor's bytes in the local file (a view of its memory map)
    checksum: str | None

    def payload(self) -> bytes:
        """The compressed delta, read when applied: one tensor's in memory a worker, not a version's.
        Read, not mapped: a shared folder's file cut short would kill the process (SIGBUS)."""
        path, offset, size = self.source
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), size, offset)
        if len(data) != size:
            raise ValueError(f"{self.name}: {path} ends before the {size} bytes of its delta")
        return data


def check_delta(version_dir: str, meta: dict) -> None:
    """Refuse a delta this host cannot apply (its formats, a missing package) before a pull
    changes anything."""
    if meta.get("compression_format") != "zstd":
        raise ValueError(f"{version_dir}: compression_format {meta.get('compression_format')!r} is not supported "
                         "(zstd)")
    if meta["delta_encoding"] not in ("xor", "overwrite"):
        raise ValueError(f"{version_dir}: delta_encoding {meta['delta_encoding']!r} is not supported "
                         "(xor or overwrite)")
    hasher(meta.get("checksum_format"))
    _zstandard()


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise RuntimeError("delta weight versions need the zstandard package: pip install zstandard") from None
    return zstandard


def apply_delta(local_dir: str, version_dir: str, meta: dict) -> None:
    """Patch local_dir's tensors with one delta version (delta_metadata's `meta`, check_delta'd)."""
    check_delta(version_dir, meta)
    encoding, algorithm = meta["delta_encoding"], meta.get("checksum_format")
    zstandard = _zstandard()
    spans = tensor_spans(local_dir)
    maps: dict[str, tuple[Any, mmap.mmap]] = {}
    try:
        patches = list(_patches(version_dir, spans, maps))

        def apply(patch: _Patch) -> str | None:
            digest, payload = hasher(algorithm), patch.payload()
            if encoding == "xor":  # streamed: a chunk decompressed, applied and hashed at a time
                _xor_streamed(zstandard, patch, payload, digest)
            else:
                bound = 4 + 5 * patch.region.size
                declared = zstandard.frame_content_size(payload)  # what decompress would allocate
                if declared > bound:
                    raise ValueError(f"{patch.name}: a delta frame of {declared} bytes for a tensor of "
                                     f"{patch.region.size}")
                _overwrite(patch, np.frombuffer(zstandard.ZstdDecompressor().decompress(
                    payload, max_output_size=bound), dtype=np.uint8))
                digest.update(patch.region)
            return None if digest.hexdigest() == patch.checksum else patch.name

        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            bad = sorted(name for name in pool.map(apply, patches) if name is not None)
    finally:
        for handle, mapped in maps.values():
            mapped.flush()  # on disk before the folder records the version
            mapped.close()
            handle.close()
    if bad:
        raise RuntimeError(f"{version_dir}: {len(bad)} tensors differ from their published checksums "
                           f"after the delta: {bad[:10]}")


def _patches(version_dir: str, spans: dict, maps: dict):
    for fname in sorted(os.listdir(version_dir)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(version_dir, fname)
        header, data = safetensors_header(path)
        size = os.path.getsize(path)
        checksums = header.get("__metadata__") or {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name not in spans:
                raise KeyError(f"{path}: tensor {name!r} is not in the local checkpoint")
            local, offset, nbytes = spans[name]
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= size - data:
                raise ValueError(f"{path}: tensor {name!r}'s data_offsets {[begin, end]} are outside the file")
            if local not in maps:
                handle = open(local, "r+b")
                maps[local] = (handle, mmap.mmap(handle.fileno(), 0))
            region = np.ndarray((nbytes,), dtype=np.uint8, buffer=maps[local][1], offset=offset)
            yield _Patch(name, (path, data + begin, end - begin), region, checksums.get(name))


def _xor_streamed(zstandard: Any, patch: _Patch, payload: bytes, digest: Any) -> None:
    """The new bytes are the old XOR the delta: XOR_CHUNK at a time (slime's frames hold whole
    tensors; an embedding's is ~1.2 GB decompressed), each hashed once patched."""
    region, done = patch.region, 0
    reader = zstandard.ZstdDecompressor().stream_reader(payload)
    while chunk := reader.read(XOR_CHUNK):
        if done + len(chunk) > region.size:
            raise ValueError(f"{patch.name}: an xor delta longer than the tensor's {region.size} bytes")
        part = region[done:done + len(chunk)]
        np.bitwise_xor(part, np.frombuffer(chunk, dtype=np.uint8), out=part)
        digest.update(part)
        done += len(chunk)
    if done != region.size:
        raise ValueError(f"{patch.name}: an xor delta of {done} bytes for a tensor of {region.size}")


def _overwrite(patch: _Patch, delta: np.ndarray) -> None:
    """u32 count, u32 byte positions, then the new byte at each."""
    region = patch.region
    count = int(delta[:4].view("<u4")[0]) if delta.size >= 4 else -1
    if count < 0 or delta.size != 4 + 5 * count:
        raise ValueError(f"{patch.name}: a malformed overwrite delta ({delta.size} bytes)")
    positions = delta[4:4 + 4 * count].view("<u4")
    if count and int(positions.max()) >= region.size:
        raise ValueError(f"{patch.name}: an overwrite position past the tensor's {region.size} bytes")
    region[positions] = delta[4 + 4 * count:]
