"""Replay: re-run recorded requests and report, bit for bit, any token or logprob that differs.

Each record is re-sent with its own prompt ids, sampling params (n = 1), the seed it actually
used and its logprob settings. Bad input never stops a replay: a malformed JSON line, a record
with a missing field, or one recorded on another model or weight version is reported (line
number, rid, field) and the rest are replayed. Records that ended in an abort are skipped (their
length depended on the abort, not on the model).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from tandem.determinism.client import GenerationClient
from tandem.determinism.compare import first_bit_diff, first_diff
from engine.api.recorder import REQUIRED_FIELDS

_LIST_FIELDS = ("input_ids", "output_ids")


@dataclass
class Record:
    line: int
    data: dict[str, Any]

    @property
    def rid(self) -> Optional[str]:
        return self.data.get("rid")

    def settings(self) -> tuple:
        d = self.data
        return (bool(d["return_logprob"]), int(d["logprob_start_len"]), int(d.get("top_logprobs_num") or 0),
                d.get("logprob_distribution"))

    def sampling_params(self) -> dict[str, Any]:
        return {**self.data["sampling_params"], "n": 1, "sampling_seed": self.data["sampling_seed"]}


@dataclass
class Problem:
    line: int
    rid: Optional[str]
    field: Optional[str]
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}" + (f" (rid {self.rid})" if self.rid is not None else "")
        return f"{where}: " + (f"field {self.field!r}: " if self.field else "") + self.message


@dataclass
class Mismatch:
    index: int  # record index among the file's records (0-based)
    line: int
    rid: Optional[str]
    kind: str  # "token" or "logprob"
    position: int  # first differing output position
    expected: Any
    got: Any

    def __str__(self) -> str:
        return (f"record {self.index} (line {self.line}, rid {self.rid}): {self.kind} differs at output "
                f"position {self.position}: recorded {self.expected!r}, replayed {self.got!r}")


@dataclass
class ReplaySummary:
    records: int = 0
    replayed: int = 0
    matched: int = 0
    mismatched: int = 0
    skipped: int = 0
    problems: list[Problem] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.mismatches


def read_records(lines: Iterable[str]) -> tuple[list[Record], list[Problem]]:
    records, problems = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(Problem(number, None, None, f"malformed JSON ({exc})"))
            continue
        if not isinstance(data, dict):
            problems.append(Problem(number, None, None, "a record must be a JSON object"))
            continue
        records.append(Record(number, data))
    return records, problems


def check_record(rec: Record, model_path: str, weight_version: str) -> Optional[Problem]:
    d = rec.data
    for name in REQUIRED_FIELDS:
        if name not in d:
            return Problem(rec.line, rec.rid, name, "missing")
    for name in _LIST_FIELDS:
        if not isinstance(d[name], list) or not all(isinstance(t, int) for t in d[name]):
            return Problem(rec.line, rec.rid, name, "must be a list of token ids")
    if not isinstance(d["sampling_params"], dict):
        return Problem(rec.line, rec.rid, "sampling_params", "must be an object")
    for name in ("sampling_seed", "logprob_start_len"):
        if not isinstance(d[name], int):
            return Problem(rec.line, rec.rid, name, "must be an integer")
    lps = d["output_token_logprobs"]
    if lps is not None and (not isinstance(lps, list) or not all(isinstance(x, (int, float)) for x in lps)):
        return Problem(rec.line, rec.rid, "output_token_logprobs", "must be a list of numbers or null")
    if not _same_model(d["model_path"], model_path):
        return Problem(rec.line, rec.rid, "model_path", f"recorded {d['model_path']!r}, engine has {model_path!r}")
    if str(d["weight_version"]) != str(weight_version):
        return Problem(rec.line, rec.rid, "weight_version",
                       f"recorded {d['weight_version']!r}, engine has {weight_version!r}")
    return None


def _same_model(recorded: Any, current: str) -> bool:
    if recorded == current:
        return True
    return isinstance(recorded, str) and os.path.realpath(recorded) == os.path.realpath(current)


class Replayer:
    def __init__(self, client: GenerationClient, batch_size: int = 64) -> None:
        self.client = client
        self.batch_size = max(1, batch_size)
        info = client.model_info()
        self.model_path, self.weight_version = info["model_path"], info.get("weight_version", "default")

    def run(self, lines: Iterable[str]) -> ReplaySummary:
        records, problems = read_records(lines)
        summary = ReplaySummary(records=len(records) + len(problems), problems=problems)
        todo: list[tuple[int, Record]] = []
        for index, rec in enumerate(records):
            problem = check_record(rec, self.model_path, self.weight_version)
            if problem is not None:
                summary.problems.append(problem)
            elif (rec.data.get("finish_reason") or {}).get("type") == "abort":
                summary.skipped += 1
            else:
                todo.append((index, rec))
        for batch in self._batches(todo):
            self._replay_batch(batch, summary)
        summary.problems.sort(key=lambda p: p.line)
        return summary

    def _batches(self, todo: list[tuple[int, Record]]) -> list[list[tuple[int, Record]]]:
        """Consecutive records with the same logprob settings, at most batch_size at a time."""
        batches: list[list[tuple[int, Record]]] = []
        for item in todo:
            last = batches[-1] if batches else None
            if last and len(last) < self.batch_size and last[0][1].settings() == item[1].settings():
                last.append(item)
            else:
                batches.append([item])
        return batches

    def _replay_batch(self, batch: list[tuple[int, Record]], summary: ReplaySummary) -> None:
        try:
            outputs = self._send([rec for _, rec in batch])
        except ValueError as exc:
            if len(batch) == 1:
                rec = batch[0][1]
                summary.problems.append(Problem(rec.line, rec.rid, None, f"the engine refused it: {exc}"))
                return
            for item in batch:  # find the record the engine refused; replay the others
                self._replay_batch([item], summary)
            return
        for (index, rec), out in zip(batch, outputs):
            summary.replayed += 1
            found = compare(index, rec, out)
            summary.mismatches.extend(found)
            summary.mismatched += bool(found)
            summary.matched += not found

    def _send(self, recs: list[Record]) -> list[dict]:
        return_logprob, start, top, distribution = recs[0].settings()
        return self.client.generate([r.data["input_ids"] for r in recs], [r.sampling_params() for r in recs],
                                    return_logprob=return_logprob, logprob_start_len=start,
                                    top_logprobs_num=top, logprob_distribution=distribution)


def compare(index: int, rec: Record, out: dict) -> list[Mismatch]:
    found = []
    want_ids, got_ids = rec.data["output_ids"], list(out.get("output_ids") or [])
    pos = first_diff(want_ids, got_ids)
    if pos is not None:
        found.append(Mismatch(index, rec.line, rec.rid, "token", pos, _at(want_ids, pos), _at(got_ids, pos)))
    want_lps = rec.data["output_token_logprobs"]
    if want_lps is not None:
        got_lps = [e[0] for e in out.get("meta_info", {}).get("output_token_logprobs") or []]
        pos = first_bit_diff(want_lps, got_lps)
        if pos is not None:
            found.append(Mismatch(index, rec.line, rec.rid, "logprob", pos, _at(want_lps, pos), _at(got_lps, pos)))
    return found


def _at(values: list, pos: int) -> Any:
    return values[pos] if pos < len(values) else "<end>"


def format_summary(summary: ReplaySummary, max_lines: int = 20) -> str:
    lines = [f"{summary.records} records: {summary.replayed} replayed, {summary.matched} identical, "
             f"{summary.mismatched} differ, {len(summary.problems)} bad, {summary.skipped} skipped (aborted)"]
    lines += [f"  differs: {m}" for m in summary.mismatches[:max_lines]]
    lines += [f"  bad: {p}" for p in summary.problems[:max_lines]]
    hidden = max(len(summary.mismatches) - max_lines, 0) + max(len(summary.problems) - max_lines, 0)
    if hidden:
        lines.append(f"  ... and {hidden} more (see --json)")
    return "\n".join(lines)
