"""What the scheduler says of a thread: how long it ran on a CPU and how long it was runnable
but waited for one (Linux's ``/proc/self/task/<tid>/schedstat``: those two, in nanoseconds,
then the number of time slices).

The warm-up exit (``ripples_pg.averager``) leaves the wait out of a step's compute: a worker
that waited for a core (more CPU-bound workers than the host has cores) was not slower at its
own work, and averaging partially cannot give the host more cores. Without it, four CPU-bound
workers on two cores read as a 1.2-1.45x straggler at every step with nobody slow.

One ``pread`` on a file kept open (~2 us), no system call to open it again. Every reading is
None where the file is missing (not Linux, or a kernel without scheduler statistics).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

__all__ = ["SchedClock"]

_RAN, _WAITED = 0, 1  # the file's fields


class SchedClock:
    """The scheduler's clocks of the thread that last called :meth:`waited` (the training
    loop's). Not shared between processes; pickles as a fresh one."""

    def __init__(self):
        self._fd: Optional[int] = None
        self._tid: Optional[int] = None
        self._ok = True

    def waited(self) -> Optional[float]:
        """Seconds the calling thread has been runnable but waited for a CPU. Opens the calling
        thread's file the first time (and when another thread calls): the other readings are
        of that thread."""
        if not self._ok:
            return None
        tid = threading.get_native_id()
        try:
            if tid != self._tid:
                self.close()
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                self._tid = tid
        except OSError:
            self._ok = False
            return None
        value = self._field(_WAITED)
        if value is None:
            self._ok = False
            self.close()
        return value

    def waited_seen(self) -> Optional[float]:
        """:meth:`waited` of the same thread, read from any thread (the backend's, completing
        an all-reduce)."""
        return self._field(_WAITED)

    def ran(self) -> Optional[float]:
        """Seconds the same thread has run on a CPU."""
        return self._field(_RAN)

    def _field(self, i: int) -> Optional[float]:
        fd = self._fd
        if fd is None:
            return None
        try:
            return int(os.pread(fd, 64, 0).split()[i]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        fd, self._fd, self._tid = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        self.close()

    def __getstate__(self):
        return {"_fd": None, "_tid": None, "_ok": self._ok}
