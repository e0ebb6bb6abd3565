"""slime's disk-delta versions pulled into a host-local checkpoint (weight_sync/local_checkpoint.py).

The publisher here writes versions the way slime's trainer does (update_weight_from_disk_delta.py):
an HF index whose metadata names the encoding, zstd-compressed per-tensor deltas in safetensors
files, and the checksum of each tensor's new bytes in the file's metadata. Every pull is checked
against the tensors it should produce, read back from the local folder.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

zstandard = pytest.importorskip("zstandard")

from weight_sync import local_checkpoint  # noqa: E402
from weight_sync.local_checkpoint import applied_version, pull, version_dir  # noqa: E402


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.norm.weight": rng.standard_normal(8).astype(np.float16),
            "lm_head.weight": rng.integers(-100, 100, (4, 8), dtype=np.int32)}


def _bytes(t: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def _adler(buf: np.ndarray) -> str:
    return f"{zlib.adler32(buf.tobytes(), 1):08x}"


def _write_full(path: str, tensors: dict) -> None:
    os.makedirs(path, exist_ok=True)
    half = len(tensors) // 2  # two shards, as a sharded HF checkpoint
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:half]}, os.path.join(path, "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, os.path.join(path, "model-00002-of-00002.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "test"}, f)


def _digest(algorithm: str, buf: np.ndarray) -> str:
    if algorithm == "adler32":
        return _adler(buf)
    if algorithm == "xxh3-128":
        import xxhash
        return xxhash.xxh3_128(buf.tobytes()).hexdigest()
    import blake3
    return blake3.blake3(buf.tobytes()).hexdigest()


def _write_delta(path: str, version: int, old: dict, new: dict, encoding: str, checksums=None,
                 algorithm: str = "adler32") -> None:
    os.makedirs(path, exist_ok=True)
    deltas, sums = {}, {}
    for name in new:
        a, b = _bytes(old[name]), _bytes(new[name])
        if np.array_equal(a, b):
            continue  # unchanged tensors are left out
        if encoding == "xor":
            raw = a ^ b
        else:
            pos = np.flatnonzero(a != b).astype("<u4")
            raw = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), b[a != b]])
        deltas[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(raw.tobytes()), dtype=np.uint8)
        sums[name] = _digest(algorithm, b)
    save_file(deltas, os.path.join(path, "model-00001-of-00001.safetensors"), metadata=checksums or sums)
    meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": encoding,
            "compression_format": "zstd", "checksum_format": algorithm}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": meta, "weight_map": {n: "model-00001-of-00001.safetensors" for n in deltas}}, f)


def _local(path: str) -> dict:
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _assert_holds(path: str, want: dict) -> None:
    got = _local(path)
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


@pytest.fixture
def stream(tmp_path):
    """base (version 0), deltas 1 (xor) and 2 (overwrite, one tensor unchanged), full 3, delta 4."""
    v = [_tensors(0), _tensors(1), _tensors(2), _tensors(3), _tensors(4)]
    v[2]["model.norm.weight"] = v[1]["model.norm.weight"]
    v[2]["model.embed.weight"] = v[1]["model.embed.weight"].copy()
    v[2]["model.embed.weight"][3, 5] = 7.0  # a few changed bytes: overwrite's case
    base, src = str(tmp_path / "base"), str(tmp_path / "published")
    _write_full(base, v[0])
    _write_delta(version_dir(src, 1), 1, v[0], v[1], "xor")
    _write_delta(version_dir(src, 2), 2, v[1], v[2], "overwrite")
    _write_full(version_dir(src, 3), v[3])
    _write_delta(version_dir(src, 4), 4, v[3], v[4], "xor")
    return base, src, v, str(tmp_path / "local")


def test_versions_pulled_in_order_hold_each_published_state(stream):
    base, src, v, local = stream
    assert pull(local, base, src, 0) == 1 and applied_version(local) == 0  # the engine's own checkpoint
    _assert_holds(local, v[0])
    assert os.path.exists(os.path.join(local, "config.json"))
    for target in (1, 2, 3, 4):
        pull(local, base, src, target)
        assert applied_version(local) == target
        _assert_holds(local, v[target])
    assert pull(local, base, src, 4) == 0  # already there: nothing read or written


def test_a_fresh_folder_seeds_from_the_newest_full_version(stream):
    base, src, v, local = stream
    assert pull(local, base, src, 2) == 3  # base, then deltas 1 and 2
    _assert_holds(local, v[2])
    fresh = local + "-2"
    assert pull(fresh, base, src, 4) == 2  # the full version 3, then delta 4: never the base
    _assert_holds(fresh, v[4])


def test_a_folder_ahead_of_the_target_starts_again(stream):
    base, src, v, local = stream
    pull(local, base, src, 4)
    pull(local, base, src, 1)  # a rewound run
    _assert_holds(local, v[1])


def test_a_checksum_mismatch_fails_loudly_and_the_next_pull_reseeds(stream):
    base, src, v, local = stream
    pull(local, base, src, 0)
    shard = os.path.join(local, "model-00001-of-00002.safetensors")
    blob = bytearray(open(shard, "rb").read())
    blob[-1] ^= 0xFF  # a flipped byte in the local copy: the delta lands on wrong bytes
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(RuntimeError, match="differ from their published checksums"):
        pull(local, base, src, 1)
    assert applied_version(local) is None  # not version 0 any more, nor 1
    pull(local, base, src, 1)
    _assert_holds(local, v[1])


@pytest.mark.parametrize("damage", ["missing_version", "wrong_base", "unknown_tensor", "short_xor", "truncated",
                                    "bad_target"])
def test_bad_publications_are_refused_by_name(stream, damage):
    base, src, v, local = stream
    pull(local, base, src, 0)
    target, match = 1, None
    index = os.path.join(version_dir(src, 1), "model.safetensors.index.json")
    if damage == "missing_version":
        target, match = 6, "weight_v000006 does not exist"
    elif damage == "wrong_base":
        meta = json.load(open(index))
        meta["metadata"]["base_version"] = "000007"
        json.dump(meta, open(index, "w"))
        match = "expected 1 on 0"
    elif damage == "unknown_tensor":
        renamed = {("x." + k): t for k, t in _tensors(1).items()}
        _write_delta(version_dir(src, 1), 1, {("x." + k): t for k, t in v[0].items()}, renamed, "xor")
        match = "is not in the local checkpoint"
    elif damage == "short_xor":
        shard = os.path.join(version_dir(src, 1), "model-00001-of-00001.safetensors")
        save_file({"model.norm.weight": np.frombuffer(zstandard.ZstdCompressor().compress(b"\x01\x02"), np.uint8)},
                  shard, metadata={"model.norm.weight": "0"})
        match = "an xor delta of 2 bytes"
    elif damage == "truncated":  # a copy cut short: its header names bytes the file lacks
        shard = os.path.join(version_dir(src, 1), "model-00001-of-00001.safetensors")
        os.truncate(shard, os.path.getsize(shard) - 1)
        match = "are outside the file"
    else:
        target, match = -1, "non-negative integer"
    with pytest.raises((ValueError, RuntimeError, KeyError, FileNotFoundError), match=match):
        pull(local, base, src, target)


def test_the_pre_read_hook_runs_first(stream, monkeypatch):
    base, src, v, local = stream
    seen = []
    monkeypatch.setattr(local_checkpoint, "_import", lambda path: lambda s, t: seen.append((path, s, t)))
    pull(local, base, src, 2, pre_read_hook="site.refresh")
    assert seen == [("site.refresh", src, 2)]
    _assert_holds(local, v[2])


@pytest.mark.parametrize("algorithm", ["xxh3-128", "blake3"])
def test_slimes_default_checksum_and_blake3(tmp_path, algorithm):
    pytest.importorskip({"xxh3-128": "xxhash", "blake3": "blake3"}[algorithm])
    old, new = _tensors(0), _tensors(1)
    base, src, local = str(tmp_path / "base"), str(tmp_path / "src"), str(tmp_path / "local")
    _write_full(base, old)
    _write_delta(version_dir(src, 1), 1, old, new, "xor", algorithm=algorithm)
    assert pull(local, base, src, 1) == 2
    _assert_holds(local, new)


def test_a_delta_this_host_cannot_read_changes_nothing(stream, monkeypatch):
    base, src, v, local = stream
    pull(local, base, src, 1)
    index = os.path.join(version_dir(src, 2), "model.safetensors.index.json")
    meta = json.load(open(index))
    meta["metadata"]["checksum_format"] = "crc64"
    json.dump(meta, open(index, "w"))
    with pytest.raises(ValueError, match="checksum_format 'crc64' is not supported"):
        pull(local, base, src, 2)
    assert applied_version(local) == 1  # refused before any change: still version 1
    _assert_holds(local, v[1])


@pytest.mark.parametrize("where", ["relative", "empty", "foreign"])
def test_only_new_empty_or_own_folders_are_pulled_into(stream, tmp_path, where):
    base, src, v, local = stream
    if where == "foreign":  # a folder of someone's files: a pull would replace or remove them
        local = str(tmp_path / "home")
        os.makedirs(local)
        open(os.path.join(local, "notes.txt"), "w").write("mine")
    target = {"relative": "ckpt", "empty": "", "foreign": local}[where]
    with pytest.raises(ValueError, match="absolute path" if where != "foreign" else "no /pull_weights folder"):
        pull(target, base, src, 0)
    if where == "foreign":
        assert open(os.path.join(local, "notes.txt")).read() == "mine"
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert pull(empty, base, src, 0) == 1  # an empty folder is taken


def test_a_folder_seeded_from_another_base_is_seeded_again(stream, tmp_path):
    base, src, v, local = stream
    pull(local, base, src, 1)
    other = str(tmp_path / "other-base")
    _write_full(other, v[0])
    assert applied_version(local, other) is None and applied_version(local, base) == 1
    assert pull(local, other, src, 1) == 2  # the other base, then delta 1 again
    _assert_holds(local, v[1])


@pytest.mark.parametrize("algorithm", ["adler32", "xxh3-128"])
def test_xor_deltas_apply_and_hash_a_chunk_at_a_time(stream, monkeypatch, algorithm):
    """Small chunks (7 bytes: ragged against every tensor) give the same tensors and checksums
    as one piece; a delta longer than its tensor is refused by name."""
    from weight_sync import checkpoint_delta

    pytest.importorskip("xxhash") if algorithm == "xxh3-128" else None
    base, src, v, local = stream
    monkeypatch.setattr(checkpoint_delta, "XOR_CHUNK", 7)
    if algorithm != "adler32":  # republish version 1 under slime's default checksum
        import shutil
        shutil.rmtree(version_dir(src, 1))
        _write_delta(version_dir(src, 1), 1, v[0], v[1], "xor", algorithm=algorithm)
    pull(local, base, src, 1)
    _assert_holds(local, v[1])
    longer = np.frombuffer(zstandard.ZstdCompressor().compress(b"\x01" * 100), np.uint8)
    shard = os.path.join(version_dir(src, 4), "model-00001-of-00001.safetensors")
    save_file({"model.norm.weight": longer}, shard, metadata={"model.norm.weight": "0"})
    with pytest.raises(ValueError, match="an xor delta longer than the tensor's 16 bytes"):
        pull(local, base, src, 4)


def test_a_version_published_again_with_other_files_is_seeded_again(stream):
    """A resumed run writes weight_v000002 anew: the folder holding the old 2 must not take delta 3
    onto it (an overwrite delta leaves every byte it does not name as it was)."""
    import shutil

    base, src, v, local = stream
    pull(local, base, src, 2)
    _assert_holds(local, v[2])
    again = _tensors(22)
    shutil.rmtree(version_dir(src, 2))
    _write_full(version_dir(src, 2), again)
    assert pull(local, base, src, 2) == 1  # seeded from the new full version 2
    _assert_holds(local, again)
    assert pull(local, base, src, 2) == 0  # and known from then on


def test_a_held_version_since_removed_still_takes_the_next_delta(stream):
    import shutil

    base, src, v, local = stream
    pull(local, base, src, 1)
    shutil.rmtree(version_dir(src, 1))  # a publisher that prunes old versions
    assert pull(local, base, src, 2) == 1  # delta 2 onto the 1 it holds
    _assert_holds(local, v[2])
