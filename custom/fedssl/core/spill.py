"""A contribution held aside outside the process's memory, in a temporary file that never has a name.

An aggregator that bounds each weight relative to the others must hold the round's largest claim until the other
weights are known (``fedssl.flare.fedavg_aggregator``).  Held in memory, that is one more model on the server
(issue 46: FLARE's own aggregator holds its sum and nothing else).  :class:`SpilledState` writes the arrays to an
unlinked temporary file instead and streams them back a piece at a time when the claim is finally added:

- the file is unlinked when it is made (``tempfile.TemporaryFile``), so nothing of a site is left on disk after
  :meth:`SpilledState.close` or the process's end, however the process ends, and no name on disk points at it;
- reading back goes through one reused buffer of ``PIECE_BYTES``: the peak memory does not grow with the model;
- a server whose temporary directory cannot take the file keeps the arrays in memory (:func:`hold`), as before,
  and says so once: the round loses nothing.
"""

from __future__ import annotations

import tempfile
from typing import Iterator, Mapping

import numpy as np

#: bytes read back at a time (4 MiB)
PIECE_BYTES = 1 << 22


class SpilledState:
    """The arrays of ``state`` in an unlinked temporary file (under ``directory``, default the system's)."""

    def __init__(self, state: Mapping[str, np.ndarray], directory: str | None = None):
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self._offsets: dict[str, int] = {}
        self._file = tempfile.TemporaryFile(dir=directory)
        try:
            for k, v in state.items():
                a = np.asarray(v)
                a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
                self._offsets[k] = self._file.tell()
                self.shapes[k], self.dtypes[k] = a.shape, a.dtype
                self._file.write(a.reshape(-1).view(np.uint8).data)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        self._buffer = bytearray(0)

    def pieces(self, key: str) -> Iterator[tuple[int, np.ndarray]]:
        """``(index of its first value, values)`` of ``key``'s flattened array, ``PIECE_BYTES`` at a time.  Every
        piece is a view of one reused buffer: use it before asking for the next."""
        dtype = self.dtypes[key]
        size = int(np.prod(self.shapes[key], dtype=np.int64))
        per = max(1, PIECE_BYTES // dtype.itemsize)
        if len(self._buffer) < min(per, size) * dtype.itemsize:
            self._buffer = bytearray(min(per, size) * dtype.itemsize)
        self._file.seek(self._offsets[key])
        for start in range(0, size, per):
            n = min(per, size - start)
            view = memoryview(self._buffer)[:n * dtype.itemsize]
            if self._file.readinto(view) != len(view):
                raise OSError(f"spilled state: {key!r} could not be read back whole")
            yield start, np.frombuffer(view, dtype=dtype)

    def close(self) -> None:
        """Free the file's space (it has no name: closing it is the end of it)."""
        self._file.close()
        self._buffer = bytearray(0)


class HeldInMemory:
    """:class:`SpilledState`'s reading side over arrays kept in memory (the fallback of :func:`hold`)."""

    def __init__(self, state: Mapping[str, np.ndarray]):
        self._arrays = {k: np.asarray(v) for k, v in state.items()}
        self.shapes = {k: a.shape for k, a in self._arrays.items()}
        self.dtypes = {k: a.dtype for k, a in self._arrays.items()}

    def pieces(self, key: str) -> Iterator[tuple[int, np.ndarray]]:
        yield 0, self._arrays[key].reshape(-1)

    def close(self) -> None:
        self._arrays = {}


def hold(state: Mapping[str, np.ndarray], directory: str | None = None) -> tuple[SpilledState | HeldInMemory, str]:
    """``state`` held aside: spilled to an unlinked temporary file, or, when the file cannot be written, kept in
    memory; with the reason it was kept in memory ('' when spilled)."""
    try:
        return SpilledState(state, directory), ""
    except OSError as e:
        return HeldInMemory(state), f"{type(e).__name__}: {e}"
