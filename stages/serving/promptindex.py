"""Where each prompt of a generate run is: its line in the prompts file and its answer in
the request cache, in arrays (bytes a prompt, never a dict of prompts or replies).

`PromptLocations(path, limit, namespace)` reads the prompts file once, checking each
line; `locate(cache, retry_failed)` points each prompt at its cached record;
`pending()` lists the requests still to send, each distinct request once; `line(fd, i)`
reads prompt `i` again. docs/stages.md, generate, "Resume".
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from pathlib import Path
from typing import Optional

import numpy as np

from stages.chat import conversation
from stages.common.errors import StageError
from stages.common.reading import json_object, open_regular
from stages.serving.cacherecords import cached_record
from stages.serving.client import TRY_MARK
from stages.serving.requestcache import KeyIndex, RequestCache, request_key

log = logging.getLogger(__name__)


class PromptLocations:
    """Where each prompt is in the prompts file and in the cache: arrays, not objects."""

    def __init__(self, path: Path, limit: Optional[int], namespace: str):
        self.path = path
        offsets = array("q")
        keys = bytearray()
        pos = 0
        self.tools = False  # whether any prompt carries tools (an engine needs a parser)
        try:
            f = open_regular(path)
        except FileNotFoundError:
            raise StageError(f"{path}: not found (run the prepare stage first)") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(offsets) >= limit:
                    break
                prompt = _parse_prompt(line, path, lineno)
                self.tools = self.tools or bool(prompt.get("tools"))
                offsets.append(pos)
                keys += request_key(namespace, prompt["messages"], prompt.get("tools"))
                pos += len(line)
        offsets.append(pos)
        self.n = len(offsets) - 1
        self.offsets = np.frombuffer(offsets, dtype=np.int64).copy()
        self.index = KeyIndex(bytes(keys))
        self.seg = np.full(self.n, -1, dtype=np.int32)
        self.off = np.zeros(self.n, dtype=np.int64)
        self.ok = np.zeros(self.n, dtype=bool)

    def locate(self, cache: RequestCache, retry_failed: bool) -> int:
        """Point every prompt at its cached reply; a completion beats a cached failure.

        Returns how many damaged records were dropped (their requests are sent again).
        """
        damaged = 0
        for key, seg, off, js in cache.scan():
            idxs = self.index.find(key)
            if not idxs or (self.seg[idxs[0]] >= 0 and self.ok[idxs[0]]):
                continue
            rec = cached_record(js)
            if rec is None:
                damaged += 1
                continue
            good = rec["ok"]
            if not good and (retry_failed or self.seg[idxs[0]] >= 0):
                continue
            self.set(idxs, seg, off, good)
        damaged += cache.damaged
        if damaged:
            log.warning(
                "request cache %s: dropped %d damaged record(s); a request left without an "
                "intact record is sent again",
                cache.dir, damaged,
            )  # fmt: skip
        return damaged

    def set(self, idxs: list[int], seg: int, off: int, good: bool) -> None:
        self.seg[idxs] = seg
        self.off[idxs] = off
        self.ok[idxs] = good

    def pending(self) -> array:
        """Prompts without a cached reply, each distinct request once (8 bytes each)."""
        missing = np.flatnonzero(self.seg < 0)
        keep = np.ones(len(missing), dtype=bool)
        for k in np.flatnonzero(self.index.shared[missing]).tolist():
            i = int(missing[k])
            keep[k] = self.index.twins(i)[0] == i
        out = array("q")
        out.frombytes(missing[keep].astype(np.int64).tobytes())
        return out

    def first_prompt(self) -> dict:
        with open_regular(self.path) as f:
            return json.loads(f.readline())

    def line(self, fd: int, i: int) -> bytes:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return os.pread(fd, end - start, start)


def _parse_prompt(line: bytes, path: Path, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    prompt = json_object(line, where)
    if not isinstance(prompt.get("id"), str) or not prompt["id"]:
        raise StageError(f"{where}: missing string 'id'")
    if TRY_MARK in prompt["id"]:  # request ids are made prefix-free with it
        raise StageError(f"{where}: id {prompt['id'][:80]!r} holds {TRY_MARK!r}, which "
                         "the request ids sent to the engine reserve (prepare's ids are hex)")
    bad = conversation.problem(prompt.get("messages"), prompt.get("tools")) or \
        conversation.unicode_problem(line, prompt)
    if bad:
        raise StageError(f"{where}: {bad}")
    return prompt
