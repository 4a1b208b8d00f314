"""Earlier answers, searchable by their suffixes: the memory suffix decoding drafts from, shared by every request
of an engine, bounded in bytes, optionally kept in a file across restarts.

The answers sit in one flat int32 array, each followed by a -1 separator. Where the text continues the way an
earlier answer did, the context's last tokens occur in it: `matches` finds the occurrences with the longest match
(up to MAX_MATCH tokens), by looking up the context's last two tokens in an index sorted by bigram (binary search)
and extending backwards (a few candidates in Python, many at once in numpy). Each answer's bigrams are merged into
the index when it is added. When the pool outgrows its bytes, the oldest answers leave (and the index is rebuilt).

Why our own: ArcticInference's suffix tree (the implementation vLLM's `suffix` method uses) ships as a source
distribution only, built with CMake against torch, nanobind 2.9.2, a pinned protobuf 5.29 and grpcio-tools,
alongside its vLLM plugin: more to build on a user's laptop than specdecode itself, and its protobuf pin
conflicts with what Ray Serve installs. A sorted bigram index does what drafting needs of a suffix tree (longest
match, continuation counts) in ~24 bytes a token.
"""

from __future__ import annotations

import atexit
import bisect
import glob
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from specdecode.atomic_files import fsync_folder
from specdecode.errors import SpecdecodeError

DEFAULT_POOL_MB = 64.0
MAX_MATCH = 32  # the longest suffix compared (a longer match predicts no better)
MAX_CANDIDATES = 512  # occurrences of the last bigram extended backwards, most recent first
FEW_CANDIDATES = 32  # compared in Python; more in numpy
BYTES_PER_TOKEN = 24  # each answer (4), the flat array (4), its sorted bigram keys (8) and positions (8)
FORMAT = 1
SAVE_EVERY_S = 30.0  # a pool with a file writes it at most this often while serving (and when closed)
SEPARATOR = -1
TEMPORARY = ".tmp"  # how a save's file ends until it is renamed over the pool's
log = logging.getLogger("specdecode")


def match_lengths(tokens: np.ndarray, candidates: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """For each candidate position p (tokens[p - 1] == tail[-1]): how many of `tail`'s last tokens end at p - 1.
    All candidates and depths at once (one gather): a round of numpy calls per matched token cost ~0.1 ms a step
    where text repeats."""
    depth = min(tail.size, MAX_MATCH)
    at = candidates[:, None] - np.arange(1, depth + 1)  # [candidates, depth]: p - k, k = 1 .. depth
    same = (at >= 0) & (tokens[np.maximum(at, 0)] == tail[::-1][:depth])
    same[:, 0] = True  # tokens[p - 1] == tail[-1]: how the candidates were found
    return np.cumprod(same, axis=1).sum(axis=1)  # the leading run of matches


def continuations(tokens: np.ndarray, positions: list[int], depth: int) -> list[list[int]]:
    """What followed each position, up to `depth` tokens, cut at an answer's end: lists (a trie is built of them
    in Python; four numpy calls a run cost ~0.1 ms a step on the caches a forward flushed)."""
    found = []
    for p in positions:
        run = tokens[p : p + depth].tolist()
        if SEPARATOR in run:
            run = run[: run.index(SEPARATOR)]
        if run:
            found.append(run)
    return found


def best_matches(tokens: np.ndarray, candidates: np.ndarray, tail: np.ndarray) -> tuple[np.ndarray, int]:
    """The candidates (most recent first) whose match with `tail` is the longest -> (positions, that length)."""
    if candidates.size == 0:
        return candidates, 0
    candidates = candidates[::-1][:MAX_CANDIDATES]
    if candidates.size <= FEW_CANDIDATES:
        positions, best = best_of_few(tokens, candidates.tolist(), tail.tolist())
        return np.asarray(positions, dtype=np.int64), best
    lengths = match_lengths(tokens, candidates, tail)
    best = int(lengths.max())
    return candidates[lengths == best], best


def best_of_few(tokens: np.ndarray | list[int], candidates: list[int], tail: list[int]) -> tuple[list[int], int]:
    """best_matches for a few candidates (most recent first), in Python, over an array or a list of tokens: the
    same lengths as match_lengths, without its dozen numpy calls (each costs tens of microseconds on the caches a
    forward flushed)."""
    depth = min(len(tail), MAX_MATCH)
    wanted = tail[::-1][:depth]  # wanted[k - 1] = tail[-k]
    best, found = 0, []
    for p in candidates:
        before = tokens[max(0, p - depth) : p]
        before = (before.tolist() if isinstance(before, np.ndarray) else before)[::-1]  # before[k - 1] = tokens[p - k]
        n = 1  # tokens[p - 1] == tail[-1]: how the candidates were found
        while n < len(before) and before[n] == wanted[n]:
            n += 1
        if n > best:
            best, found = n, [p]
        elif n == best:
            found.append(p)
    return found, best


class SuffixPool:
    def __init__(self, max_mb: float = DEFAULT_POOL_MB, fingerprint: str = "", path: str | None = None) -> None:
        """`fingerprint`: the tokenizer's (a file written under another is refused). `path`: loaded if it exists,
        written (atomically) by `save`."""
        if not (max_mb > 0 and math.isfinite(max_mb)):
            raise SpecdecodeError(f"--suffix-pool-mb must be more than 0 (got {max_mb}): it bounds the answers "
                                  "suffix drafting remembers")
        self.max_tokens = int(max_mb * 2**20 / BYTES_PER_TOKEN)
        self.fingerprint = fingerprint
        self.path = Path(path) if path else None
        self.answers: deque[np.ndarray] = deque()
        self.size = 0  # tokens held, separators included
        self.flat = np.empty(0, dtype=np.int32)
        self.keys = np.empty(0, dtype=np.int64)  # bigram keys of the indexed positions, sorted
        self.at = np.empty(0, dtype=np.int64)  # the positions (after each bigram), ascending within a key
        self.indexed = 0  # positions of `flat` before this are in the index (all, once add returns)
        self.changed = False
        self.saved_at = time.monotonic()
        # The compute thread adds answers while a save (a background writer, or the exit's) reads them.
        self.lock = threading.Lock()
        self.saving = False
        self.writer: threading.Thread | None = None
        if self.path is not None:
            self._remove_stray_temporaries()
            if self.path.exists():
                self._load(self.path)

    def add(self, answer: list[int]) -> None:
        """Remember a finished answer (the oldest leave when the pool is full)."""
        if len(answer) < 2:
            return
        tokens = np.asarray(answer, dtype=np.int32)
        with self.lock:
            self.answers.append(tokens)
            self.size += tokens.size + 1
            self.changed = True
            full = self.size > self.max_tokens
            while full and self.answers and self.size > 0.75 * self.max_tokens:
                self.size -= self.answers.popleft().size + 1
        if full:
            self._rebuild()
            return
        self.flat = np.concatenate((self.flat, tokens, [SEPARATOR])).astype(np.int32, copy=False)
        self._index_from(self.indexed)

    def _index_from(self, begin: int) -> None:
        """Positions [begin, end) of `flat` into the sorted index: their keys sorted and merged in (an O(n) copy
        once per answer), after the equal keys already there, so positions stay ascending within a key. Scanning
        the answers not yet indexed instead cost each step a few numpy passes over them."""
        start = max(begin, 2)
        region = self.flat[start - 2 :].astype(np.int64)
        keys = _key(region[:-2], region[1:-1])  # the bigram before position p = start .. n - 1
        valid = (region[:-2] >= 0) & (region[1:-1] >= 0)
        at = np.flatnonzero(valid) + start
        keys = keys[valid]
        order = np.argsort(keys, kind="stable")
        keys, at = keys[order], at[order]
        where = np.searchsorted(self.keys, keys, side="right")
        self.keys, self.at = np.insert(self.keys, where, keys), np.insert(self.at, where, at)
        self.indexed = self.flat.size

    def snapshot(self) -> tuple[np.ndarray, ...]:
        return tuple(self.answers)

    def restore(self, state: tuple[np.ndarray, ...]) -> None:
        with self.lock:
            self.answers = deque(state)
            self.size = sum(a.size + 1 for a in state)
        self._rebuild()

    def matches(self, tail: list[int] | np.ndarray) -> tuple[list[int], int]:
        """Positions after the longest matches of the context's end `tail` (most recent first) -> (positions,
        match length). Every position is indexed (add, _rebuild)."""
        flat = self.flat
        if len(tail) < 2 or flat.size < 3:
            return [], 0
        key = int(tail[-2]) * (1 << 31) + int(tail[-1])  # _key's, in Python ints
        # bisect reads ~20 of the sorted keys: np.searchsorted's array in and list out cost ~40 us on the caches a
        # forward flushed, the comparisons ~5
        keys = self.keys
        lo = bisect.bisect_left(keys, key)
        hi = bisect.bisect_left(keys, key + 1, lo)
        if hi - lo <= FEW_CANDIDATES:  # best_matches' Python branch, without its arrays around it
            return best_of_few(flat, self.at[max(lo, hi - MAX_CANDIDATES) : hi].tolist()[::-1], list(tail[-MAX_MATCH:]))
        positions, length = best_matches(flat, self.at[lo:hi], np.asarray(tail, dtype=np.int64))
        return positions.tolist(), length

    def _rebuild(self) -> None:
        parts = [np.append(a, SEPARATOR) for a in self.answers]
        self.flat = np.concatenate(parts).astype(np.int32) if parts else np.empty(0, dtype=np.int32)
        flat = self.flat.astype(np.int64)
        keys = _key(flat[:-2], flat[1:-1])  # the bigram before position p = 2 .. n - 1
        valid = (flat[:-2] >= 0) & (flat[1:-1] >= 0)
        at = np.flatnonzero(valid) + 2
        order = np.argsort(keys[valid], kind="stable")
        self.keys, self.at = keys[valid][order], at[order]
        self.indexed = self.flat.size

    # --- kept across restarts ---------------------------------------------------------------------------------

    def save_soon(self) -> None:
        """Save in the background if the last save is SAVE_EVERY_S old (a server keeps most of its pool through a
        crash; writing megabytes inside a step would stall every request in it)."""
        if self.path is None or self.saving or time.monotonic() - self.saved_at < SAVE_EVERY_S:
            return
        self.saving = True
        self.writer = threading.Thread(target=self.save_or_warn, name="suffix-pool-save", daemon=True)
        self.writer.start()

    def close(self) -> None:
        """At exit: let a background save finish, then save what came after it."""
        if self.writer is not None:
            self.writer.join()
        self.save_or_warn()

    def save_or_warn(self) -> None:
        """`save`, where a full disk or a read-only folder costs the file, not the request or the server."""
        try:
            self.save()
        except OSError as e:
            log.warning("specdecode: could not write the suffix pool to %s: %s", self.path, e)
        finally:
            self.saving = False

    def save(self) -> None:
        """Write the pool to its file if anything changed: a temporary file renamed over it, never half written."""
        with self.lock:  # one consistent list of answers; what is added after it is saved next time
            if self.path is None or not self.changed:
                return
            answers, self.changed = list(self.answers), False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lengths = np.array([a.size for a in answers], dtype=np.int64)
            tokens = np.concatenate(answers) if answers else np.empty(0, dtype=np.int32)
            handle, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=TEMPORARY)
            try:
                with os.fdopen(handle, "wb") as f:
                    np.savez(f, format=np.array(FORMAT), fingerprint=np.array(self.fingerprint), lengths=lengths,
                             tokens=tokens)
                    f.flush()
                    os.fsync(f.fileno())  # on disk before the rename: a power cut leaves the old file or this one
                os.replace(tmp, self.path)
                fsync_folder(self.path.parent)  # the rename itself on disk
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except BaseException:
            self.changed = True
            raise
        self.saved_at = time.monotonic()

    def _remove_stray_temporaries(self) -> None:
        """Delete what a save killed midway (SIGKILL, a power cut) left beside the file: one process per pool
        file, so none of them is still being written."""
        for stray in self.path.parent.glob(f"{glob.escape(self.path.name)}*{TEMPORARY}"):
            try:
                stray.unlink()
            except OSError as e:
                log.warning("specdecode: could not remove %s, left by an interrupted save: %s", stray, e)

    def _load(self, path: Path) -> None:
        try:
            with np.load(path, allow_pickle=False) as f:
                version, fingerprint = int(f["format"]), str(f["fingerprint"])
                lengths, tokens = f["lengths"], f["tokens"]
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which and why, in one line
            raise SpecdecodeError(f"--suffix-pool {path} is unreadable or truncated ({type(e).__name__}): move it "
                                  "away or delete it to start an empty pool") from None
        if version != FORMAT:
            raise SpecdecodeError(f"--suffix-pool {path} has format {version}, this version reads {FORMAT}")
        if fingerprint != self.fingerprint:
            raise SpecdecodeError(f"--suffix-pool {path} was written for another tokenizer: its token ids mean "
                                  "other text here; give another path")
        if (lengths.dtype.kind not in "iu" or tokens.dtype.kind not in "iu" or lengths.sum() != tokens.size
                or (tokens.size and tokens.min() < 0) or (lengths.size and lengths.min() < 0)):
            raise SpecdecodeError(f"--suffix-pool {path} is corrupt (its answers and tokens disagree)")
        for answer in np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1]) if lengths.size else []:
            self.answers.append(answer)
            self.size += answer.size + 1
        while self.answers and self.size > self.max_tokens:
            self.size -= self.answers.popleft().size + 1
        self._rebuild()


def open_pool(max_mb: float, path: str | None, tokenizer) -> SuffixPool:
    """The pool a loaded decoder drafts from: read from `path` if it exists, and written back there at exit."""
    if path and tokenizer is None:
        raise SpecdecodeError("--suffix-pool needs the target's tokenizer, to check that a saved pool's token ids "
                              "mean the same text")
    pool = SuffixPool(max_mb, tokenizer_fingerprint(tokenizer) if path else "", path)
    if path:
        atexit.register(pool.close)
    return pool


def tokenizer_fingerprint(tokenizer) -> str:
    """What makes token ids mean the same text: the vocabulary, hashed."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _key(a, b):
    return np.asarray(a, dtype=np.int64) * (1 << 31) + np.asarray(b, dtype=np.int64)
