"""The compile's read plan as the source stream sees it (`source_stream.py`): which planned request needs which
window chunk, how far each request has been served, and so which chunks the window must keep.

A request is one planned tensor [begin, end) of one weight file, served whole or in row slices in ascending order
(an expert bank reads its fused [E, rows, cols] tensors one expert at a time, two tensors interleaved; a big tensor
is copied out chunk by chunk). `served[j]`: the end of the contiguous prefix of request j delivered so far; chunk k
is released by j once that prefix covers j's part of it. A chunk is pinned while a holder has not released it. A
request the compile passed over without reading (`cur`, the latest request started, moved beyond it) releases all.

Two budgets (kept by the stream): chunks pinned by a big request (> `big` bytes) count against `hold`, the rest
against `window`. Big pins are what let a fused bank be read once: safetensors stores down_proj [E, H, I] before
gate_up_proj [E, 2I, H] (names are sorted), the compile wants gate_up[e] with down[e], so down waits in the window
while gate_up streams by. Past `hold`, the pinned chunks needed last (highest request index, then highest offset:
lm_head, planned last, goes first) are dropped: the pass still hashes them, the compile reads them directly.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ft.compiler.safetensors_io import TensorInfo

Key = tuple[int, int]  # (file index, chunk index)


class ReadPlan:
    def __init__(self, infos: list[TensorInfo], fidx: dict[Path, int], chunk: int, big: int) -> None:
        self.chunk, self.big = chunk, big
        self.index: dict[tuple[Path, int, int], int] = {}  # (path, begin, end) -> request (first occurrence)
        self.req: list[tuple[int, int, int]] = []  # (file, begin, end) per request, in plan order
        self.served: list[int] = []
        self._rel: list[int] = []  # per request: its first chunk not yet released
        self._left: dict[Key, int] = {}  # holders that have not released the chunk
        self._big_left: dict[Key, int] = {}  # of which big requests
        self._big_holders: dict[Key, list[int]] = defaultdict(list)
        self.cur = -1  # the latest request the compile started
        self.final = False  # the compile is done: nothing is pinned any more
        self.dropped: set[Key] = set()  # unpinned over budget: their requests read them directly
        self.dropped_files: set[int] = set()  # read before the plan was known, out of its order
        order: list[int] = []
        for info in infos:
            fi = fidx.get(info.path)
            if fi is None or (info.path, info.begin, info.end) in self.index:
                continue
            j = len(self.req)
            self.index[(info.path, info.begin, info.end)] = j
            self.req.append((fi, info.begin, info.end))
            self.served.append(info.begin)
            self._rel.append(info.begin // chunk)
            if fi not in order:
                order.append(fi)
            for k in self._chunks_of(j):
                self._left[(fi, k)] = self._left.get((fi, k), 0) + 1
                if info.nbytes > big:
                    self._big_left[(fi, k)] = self._big_left.get((fi, k), 0) + 1
                    self._big_holders[(fi, k)].append(j)
        self.order = order + [fi for fi in sorted(set(fidx.values())) if fi not in order]

    def _chunks_of(self, j: int) -> range:
        _, b, e = self.req[j]
        return range(b // self.chunk, (e - 1) // self.chunk + 1) if e > b else range(0)

    def _release(self, j: int, upto: int) -> None:
        """Request j releases its chunks before chunk index `upto`."""
        fi, b, e = self.req[j]
        for k in range(self._rel[j], min(upto, self._chunks_of(j).stop)):
            self._left[(fi, k)] -= 1
            if e - b > self.big:
                self._big_left[(fi, k)] -= 1
        self._rel[j] = max(self._rel[j], upto)

    def start(self, j: int) -> None:
        """The compile reads (part of) request j now: requests it passed over unread release everything."""
        for i in range(self.cur + 1, j):
            if self.served[i] == self.req[i][1]:
                self._release(i, self._chunks_of(i).stop)
        self.cur = max(self.cur, j)

    def serve(self, j: int, begin: int, end: int) -> None:
        """Bytes [begin, end) of request j were delivered (from the window or directly)."""
        _, b, e = self.req[j]
        if begin <= self.served[j] < end:
            self.served[j] = min(end, e)
        s = self.served[j]
        self._release(j, self._chunks_of(j).stop if s >= e else s // self.chunk)

    def pinned(self, key: Key) -> bool:
        return not self.final and self._left.get(key, 0) > 0 and key not in self.dropped \
            and key[0] not in self.dropped_files

    def big_pinned(self, key: Key) -> bool:
        return self.pinned(key) and self._big_left.get(key, 0) > 0

    # the two scans below run on every window change (the pass and the compile wait on them): inlined
    def big_pinned_of(self, keys) -> list[Key]:
        if self.final:
            return []
        bl, dr, df = self._big_left, self.dropped, self.dropped_files
        return [k for k in keys if bl.get(k, 0) > 0 and k not in dr and k[0] not in df]  # big_left <= left

    def unpinned_of(self, keys) -> list[Key]:
        if self.final:
            return list(keys)
        left, dr, df = self._left, self.dropped, self.dropped_files
        return [k for k in keys if left.get(k, 0) <= 0 or k in dr or k[0] in df]

    def rank(self, key: Key) -> tuple[int, int]:
        """When a big-pinned chunk is needed: its first big holder that has not released it, then its offset."""
        return min(j for j in self._big_holders[key] if self._rel[j] <= key[1]), key[1]

    def drop_last(self, held: list[Key], than: tuple[int, int]) -> Key | None:
        """Unpin the big-pinned chunk of `held` needed last, if later than `than` (a rank); returns it or None."""
        cands = self.big_pinned_of(held)
        if not cands:
            return None
        last = max(cands, key=self.rank)
        if self.rank(last) <= than:
            return None
        self.dropped.add(last)
        return last
