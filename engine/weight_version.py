"""A weight version's text: every reply carries it (meta_info, /get_server_info, /metrics), so it is
checked once where it is set: --weight-version at start, each update's weight_version, /update_weight_version."""

from __future__ import annotations

from engine.tokenizer import check_text

MAX_VERSION_CHARS = 256  # every reply's meta_info carries it: a 100,000-character one was taken


def check_version(version: str, what: str) -> str:
    """A version every reply carries (meta_info, /get_server_info, /metrics): text that encodes, or
    one bad version would break every JSON reply after it; short, and no control characters (a
    NUL or newline would land in the Prometheus label and in logs)."""
    check_text(version, what)
    if len(version) > MAX_VERSION_CHARS:
        raise ValueError(f"{what} must be at most {MAX_VERSION_CHARS} characters, got {len(version)}")
    bad = next((c for c in version if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"{what} has the control character {bad!r}; use printable text")
    return version
