"""`/pull_weights`: bring a host-local checkpoint up to a published weight version.

slime's disk-delta sync publishes versions `weight_v{N:06d}/` under a shared `source_dir`, each a
full checkpoint or a delta on the version before (weight_sync/checkpoint_delta.py). Each engine
pulls the version into its own `local_checkpoint_dir`, then slime reloads it with
`/update_weights_from_disk`. Version 0 is the engine's own checkpoint (its model path).

The folder records the version it holds in `.weight_sync/state.json` (slime's marker, plus the base
checkpoint its chain started from); a pull seeds the folder from the newest full version at or
below the target that is newer than what it holds (a copy), then applies the deltas after it in
order. Every delta of the chain is checked (formats, packages) before anything changes; then the
marker is removed until the new version's bytes are on disk, so a pull that fails or is killed
part way leaves a folder of no known version, which the next pull seeds again instead of patching
bad bytes. A folder seeded from another base (the engine restarted on another model) is seeded
again, and so is one whose version was published again with other files (a resumed run; the
marker records each version's files by name, size and time). A pull replaces and removes files:
it takes only an absolute path that is new, empty or its own folder. An exclusive lock on
`.weight_sync/lock` serialises pulls into one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
from typing import Iterator, Optional

from weight_sync.checkpoint_delta import apply_delta, check_delta, delta_metadata

logger = logging.getLogger(__name__)
STATE_DIR = ".weight_sync"


def version_dir(source_dir: str, version: int) -> str:
    return os.path.join(source_dir, f"weight_v{version:06d}")


def pull(local_dir: str, base_dir: str, source_dir: str, target_version: int,
         pre_read_hook: Optional[str] = None) -> int:
    """Bring local_dir to target_version; -> how many versions were applied (0: already there).
    pre_read_hook: "module.function", called as (source_dir, target_version) before any read
    (a shared filesystem that needs a refresh before another host's writes show)."""
    if isinstance(target_version, bool) or not isinstance(target_version, int) or target_version < 0:
        raise ValueError(f"target_version must be a non-negative integer, got {target_version!r}")
    _check_folder(local_dir)
    if target_version > 0 and pre_read_hook:
        _import(pre_read_hook)(source_dir, target_version)
    with _locked(local_dir):
        state = _state(local_dir)
        held = _held_version(state, base_dir)
        if held and _republished(state, version_dir(source_dir, held)):
            held = None  # the version it holds was published again with other files (a resumed run)
        ahead = held is not None and held > target_version  # a rewound run: start again below
        floor = 0 if held is None or ahead else held
        start, deltas = target_version, {}  # the newest full version above what the folder holds, else `floor`
        while start > floor and (meta := delta_metadata(version_dir(source_dir, start))) is not None:
            deltas[start] = meta
            start -= 1
        seed = held is None or ahead or start > held
        first = start if seed else held  # every version after it was read as a delta above
        chain = [(v, _checked(source_dir, v, deltas[v])) for v in range(first + 1, target_version + 1)]
        if not seed and not chain:
            return 0
        _forget(local_dir)  # from here until _record the folder holds no known version
        if seed:
            _copy_checkpoint(base_dir if start == 0 else version_dir(source_dir, start), local_dir)
            _record(local_dir, start, base_dir, source_dir)
        for version, meta in chain:
            logger.info("pull_weights: applying the delta of version %d", version)
            apply_delta(local_dir, version_dir(source_dir, version), meta)
            _record(local_dir, version, base_dir, source_dir)
        return int(seed) + len(chain)


def applied_version(local_dir: str, base_dir: Optional[str] = None) -> Optional[int]:
    """The version local_dir holds, None when unknown (a fresh folder, a failed pull, or, given
    base_dir, a folder seeded from another base checkpoint: the engine restarted on another model)."""
    return _held_version(_state(local_dir), base_dir)


def _state(local_dir: str) -> dict:
    """The folder's marker; {} where there is none or it does not read."""
    try:
        with open(os.path.join(local_dir, STATE_DIR, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _held_version(state: dict, base_dir: Optional[str]) -> Optional[int]:
    try:
        version = int(state["version"])
    except (KeyError, ValueError, TypeError):
        return None
    if base_dir is not None and state.get("base") != os.path.realpath(base_dir):
        return None
    return version


def _check_folder(local_dir: str) -> None:
    """A pull replaces and removes files in local_dir: only an absolute path that is new, empty,
    or a folder a pull made (its .weight_sync) is taken."""
    if not isinstance(local_dir, str) or not os.path.isabs(local_dir):
        raise ValueError(f"local_checkpoint_dir must be an absolute path, got {local_dir!r}")
    if os.path.isdir(local_dir) and os.listdir(local_dir) and not os.path.isdir(os.path.join(local_dir, STATE_DIR)):
        raise ValueError(f"local_checkpoint_dir {local_dir} holds files and is no /pull_weights folder (no "
                         f"{STATE_DIR}/): a pull would replace or remove them; give a new or empty folder")


def _checked(source_dir: str, version: int, meta: dict) -> dict:
    """A delta of the chain, refused (numbering, formats, packages) before the pull changes anything."""
    path = version_dir(source_dir, version)
    if int(meta.get("version", version)) != version or int(meta.get("base_version", -1)) != version - 1:
        raise RuntimeError(f"{path}: its index says version {meta.get('version')} on {meta.get('base_version')}, "
                           f"expected {version} on {version - 1}")
    check_delta(path, meta)
    return meta


def _copy_checkpoint(src: str, local_dir: str) -> None:
    """local_dir becomes a copy of src's files (others removed: an older sharding's shards)."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    logger.info("pull_weights: copying the full checkpoint %s into %s", src, local_dir)
    files = [e for e in os.scandir(src) if e.is_file()]
    for entry in files:
        part = os.path.join(local_dir, STATE_DIR, entry.name + ".part")
        shutil.copyfile(entry.path, part)
        if os.path.getsize(part) != entry.stat().st_size:  # a source still being written
            raise RuntimeError(f"{entry.path} changed size while it was copied")
        os.replace(part, os.path.join(local_dir, entry.name))  # a reader's open file keeps its bytes
    names = {e.name for e in files}
    for entry in os.scandir(local_dir):
        if entry.is_file() and entry.name not in names:
            os.remove(entry.path)


def _record(local_dir: str, version: int, base_dir: str, source_dir: str) -> None:
    """slime's marker ({"version": "NNNNNN"}), the base checkpoint the chain started from and the
    identity of the published version it holds."""
    path = os.path.join(local_dir, STATE_DIR, "state.json")
    source = _identity(version_dir(source_dir, version)) if version else None
    with open(path + ".tmp", "w") as f:
        json.dump({"version": f"{version:06d}", "base": os.path.realpath(base_dir), "source": source}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _identity(path: str) -> Optional[str]:
    """A published version's files by name, size and modification time (None: not there)."""
    try:
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file())
    except FileNotFoundError:
        return None
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:32]


def _republished(state: dict, held_dir: str) -> bool:
    """Whether the version the folder holds is published now with other files than it was pulled
    from; not where either side cannot tell (slime's own marker; the version since removed)."""
    recorded, now = state.get("source"), _identity(held_dir)
    return None not in (recorded, now) and recorded != now


def _forget(local_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(local_dir, STATE_DIR, "state.json"))


@contextlib.contextmanager
def _locked(local_dir: str) -> Iterator[None]:
    os.makedirs(os.path.join(local_dir, STATE_DIR), exist_ok=True)
    with open(os.path.join(local_dir, STATE_DIR, "lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import(path: str):
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"pre_read_hook {path!r} is not a 'module.function' path")
    return getattr(importlib.import_module(module), name)
