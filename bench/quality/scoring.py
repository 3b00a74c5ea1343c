"""Scoring of the quality harness: exact match of answer items, bootstrap confidence intervals,
KL and top-1 agreement of next-token distributions, and the results CSV (resumable)."""

import csv
import math
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

_ITEM = re.compile(r"[a-z0-9]+")
_SKIP = {"and"}


# A list entry: "- x", "* x", "• x", "1. x", "2) x" (numbered to 99: "1234567. x" is an answer).
_ENTRY = re.compile(r"^\s*(?:[-*\u2022]|\d{1,2}[.)])\s+")
# The start of a line that may still become an entry as more tokens come.
_MAY_BE_ENTRY = re.compile(r"^\s*(?:[-*\u2022]|\d)")


def _entry(line: str) -> bool:
    return bool(_ENTRY.match(line)) and bool(items(_ENTRY.sub("", line, count=1)))


def _span(text: str) -> Tuple[List[str], int, int]:
    """(the lines of `text`, the answer's first line, one past its last; start == end: none).

    The answer is the first line that holds an item: blank lines and lines of punctuation alone
    before it are skipped (a model may write "are:" and answer on the next line). When that line
    is a list entry, the entries right after it belong to the answer too (a model may give k
    items as a list, one per line)."""
    lines = text.lstrip().split("\n")
    start = next((i for i, line in enumerate(lines) if items(line)), len(lines))
    end = min(start + 1, len(lines))
    if start < len(lines) and _ENTRY.match(lines[start]):
        while end < len(lines) and _entry(lines[end]):
            end += 1
    return lines, start, end


def _answer(text: str) -> Tuple[List[str], bool]:
    """(the answer's lines, list markers removed; whether the text goes on past them)."""
    lines, start, end = _span(text)
    return [_ENTRY.sub("", line, count=1) for line in lines[start:end]], end < len(lines)


def answer_line(text: str) -> str:
    """The generated answer as one line (a list's entries joined by "; ")."""
    return "; ".join(line.strip() for line in _answer(text)[0])


def answer_complete(text: str) -> bool:
    """True once the answer has ended: its line is followed by a newline, or, for a list, a line
    that is not an entry has begun after it. Decoding stops there (or at EOS)."""
    lines, start, end = _span(text)
    if end == start or end == len(lines):
        return False  # no answer yet, or its last line is still being written
    if not _ENTRY.match(lines[start]) or end < len(lines) - 1:
        return True  # one line, or a whole line that is not an entry (a blank one included)
    # The line being written after the list: it may still become an entry.
    return lines[-1].strip() != "" and not _MAY_BE_ENTRY.match(lines[-1])


def items(line: str) -> List[str]:
    """Answer items of a line: lowercase alphanumeric runs, without "and"."""
    return [w for w in _ITEM.findall(line.lower()) if w not in _SKIP]


def answered(text: str, k: int) -> bool:
    """True once the answer holds k complete items: k items and something after the k-th
    (the end of the line, punctuation or a space), so that more tokens cannot change them."""
    answer, more = _answer(text)
    joined = "\n".join(answer).lower()
    found = 0
    for m in _ITEM.finditer(joined):
        if m.group() in _SKIP:
            continue
        found += 1
        if found == k:
            return m.end() < len(joined) or more
    return False


def exact_match(text: str, expected: Sequence[str]) -> bool:
    """True iff the first len(expected) items of the answer line are exactly the expected items
    (in any order, no repeats): "1234567." matches ["1234567"]; "12345678", "123456" or
    "1234567 is the number" for ["1234567", "7654321"] do not."""
    got = items("\n".join(_answer(text)[0]))[:len(expected)]
    want = [e.lower() for e in expected]
    return len(got) == len(want) and len(set(got)) == len(got) and set(got) == set(want)


def bootstrap_ci(values: Sequence[float], level: float = 0.95, n_boot: int = 10000,
                 seed: int = 0) -> Tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap CI of the mean (resampling with replacement)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2
    return (float(x.mean()), float(np.quantile(means, alpha)),
            float(np.quantile(means, 1 - alpha)))


def paired_bootstrap_diff(a: Sequence[float], b: Sequence[float], level: float = 0.95,
                          n_boot: int = 10000, seed: int = 0) -> Tuple[float, float, float]:
    """(mean(a - b), low, high) over paired samples (same prompts)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return bootstrap_ci(d, level, n_boot, seed)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_top1(ref: np.ndarray, other: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per position KL(ref || other) in nats and whether the argmaxes agree; [..., V] logits."""
    a, b = log_softmax(ref), log_softmax(other)
    kl = (np.exp(a) * (a - b)).sum(axis=-1)
    return kl, a.argmax(-1) == b.argmax(-1)


# -- the results CSV -----------------------------------------------------------------------------

FIELDS = ["model", "task", "context", "protocol", "method", "policy", "budget", "params",
          "sample", "correct", "kl", "top1", "kept_fraction", "truncated", "answer", "expected",
          "error", "seconds"]
CELL = ("model", "task", "context", "protocol", "method", "policy", "budget")


def cell_key(row: Dict[str, object]) -> Tuple[str, ...]:
    """A cell: one configuration on one task and context length (all its samples)."""
    return tuple(_canon(k, row[k]) for k in CELL)


def _canon(k: str, v: object) -> str:
    if k == "budget":
        return f"{float(v):.4g}"
    if k == "context":
        return str(int(float(v)))  # type: ignore[arg-type]
    return str(v)


class ResultStore:
    """The CSV of per-sample rows. A cell is done when it has rows for `samples` samples (or an
    error row); done cells are skipped by the harness, so a run can be stopped and restarted."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: List[Dict[str, str]] = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                self.rows = list(csv.DictReader(f))

    def samples_done(self, key: Tuple[str, ...]) -> Dict[int, Dict[str, str]]:
        return {int(r["sample"]): r for r in self.rows if cell_key(r) == key}

    def is_done(self, key: Tuple[str, ...], samples: int) -> bool:
        rows = [r for r in self.rows if cell_key(r) == key]
        if any(r.get("error") for r in rows):
            return True
        return len({int(r["sample"]) for r in rows}) >= samples

    def drop(self, doomed) -> int:
        """Removes the rows for which doomed(row) holds, in memory and in the CSV (rewritten
        through a temporary file and a rename, so a kill leaves the old or the new file whole).
        Their cells are then pending again. Returns how many rows went."""
        keep = [r for r in self.rows if not doomed(r)]
        gone = len(self.rows) - len(keep)
        if gone:
            tmp = self.path + ".tmp"
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
                w.writeheader()
                w.writerows(keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self.rows = keep
        return gone

    def add(self, rows: Iterable[Dict[str, object]]) -> None:
        new = [{k: _fmt(r.get(k, "")) for k in FIELDS} for r in rows]
        fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if fresh:
                w.writeheader()
            w.writerows(new)
        self.rows += new


def itemless(row: Dict[str, str]) -> bool:
    """A task row whose stored answer holds no item although decoding was not cut at max_new.
    Before 2026-12-01 the harness stopped at the end of the first non-blank line, so an answer
    ":" (the model answering on the lines after it) was stored as ":" and scored wrong without
    being generated; such rows are regenerated by `run.py --redo-itemless`. A row of today's
    harness is itemless only when the model ended its turn before any item (rerunning it gives
    the same row again)."""
    return (row.get("task") != "fidelity" and not row.get("error")
            and row.get("truncated") != "1" and not items(row.get("answer", "")))


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def parse_budget(v: str) -> Optional[float]:
    return None if v in ("", "1", "1.0") else float(v)
