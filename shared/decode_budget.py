"""The process-wide decode budget: a bound on the pixels a process decodes at once, and handing the
memory a large decode freed back to the OS.

The API holds one :class:`DecodeBudget` for the images and videos its requests bring (``shared.fetch``
loads them under it); the encoder holds one for the images and frames its jobs encode. Pure asyncio
and ctypes: no image library, no HTTP client, so a worker imports it without either.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DecodeBudget:
    """A bound on the pixels being decoded at once in one process, shared by all its requests.

    A decoded image costs memory in proportion to its pixels (4 bytes each for an RGB frame),
    so bounding the pixels in flight bounds the memory that decoding can take, however many
    images arrive at once. Claims are served in arrival order (a large image is not starved by a
    stream of small ones). A claim larger than the whole budget is cut down to the whole budget:
    such an image decodes alone once everything before it is done, instead of waiting forever.

    Use from one event loop. :meth:`run` holds the claim until the decode *thread* finishes, also
    when the awaiting task is cancelled (a thread cannot be stopped; its memory is still in use).
    """

    def __init__(self, pixels: int) -> None:
        if pixels < 1:
            raise ValueError("the decode budget must be at least 1 pixel")
        self.capacity = pixels
        self._free = pixels
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def in_use(self) -> int:
        """Pixels claimed now."""
        return self.capacity - self._free

    async def acquire(self, pixels: int) -> int:
        """Wait for ``pixels`` (at most the whole budget) to be free and claim them; returns the
        amount claimed, to be given to :meth:`release`."""
        claim = min(max(pixels, 1), self.capacity)
        if not self._waiters and self._free >= claim:
            self._free -= claim
            return claim
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (claim, granted)
        self._waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(claim)  # granted, then cancelled before it could run
            else:
                self._waiters.remove(entry)
                self._grant()  # it may have been the head blocking smaller claims
            raise
        return claim

    def release(self, claim: int) -> None:
        self._free += claim
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._free >= self._waiters[0][0]:
            claim, granted = self._waiters.popleft()
            self._free -= claim
            granted.set_result(None)

    async def run(self, pixels: int, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` in a worker thread (with this context's variables) once ``pixels`` are
        claimed; the claim is released when the thread finishes."""
        claim = await self.acquire(pixels)
        loop = asyncio.get_running_loop()
        try:
            done = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, fn, *args))
        except BaseException:
            self.release(claim)
            raise
        done.add_done_callback(lambda _: self.release(claim))
        # shield: cancelling the caller must not mark the decode done while its thread still runs.
        return await asyncio.shield(done)


def release_freed_memory(pixels: int) -> None:
    """After a decode of ``pixels`` pixels: hand the memory it freed back to the OS if it was
    large (at least :data:`TRIM_AFTER_PIXELS`; glibc only, a no-op elsewhere).

    Pillow allocates a large image in 16 MB blocks; once glibc's dynamic mmap threshold has grown
    past that, the blocks come from malloc arenas, and freeing them leaves the pages in the
    process (measured: ~770 MB kept after eight 36-Mpx decodes). ``malloc_trim(0)`` returns the
    free pages of every arena."""
    if pixels >= TRIM_AFTER_PIXELS and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()
#: Images of at least this many pixels trim the allocator after they are hashed.
TRIM_AFTER_PIXELS = 4_000_000
