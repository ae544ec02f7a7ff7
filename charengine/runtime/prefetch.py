"""The engine's files read into the page cache in the background from the moment charrun
starts: the operating system reads them (posix_fadvise WILLNEED) while the process imports
torch, so the weights' reads that follow hit the cache instead of the disk.

    readahead(engine_dir) -> int        ask for every file under engine_dir; the bytes asked
    readahead_in_background(engine_dir) the same on a daemon thread (the hint itself can take
                                        a while to queue gigabytes); returns the thread
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def readahead(engine_dir) -> int:
    """Start background reads of every regular file under engine_dir; returns the bytes
    asked for. A hint only: a system without posix_fadvise, or a file that cannot be opened,
    is passed over (the load reports what it cannot read)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    asked = 0
    for path in sorted(Path(engine_dir).rglob("*")):
        try:
            if not path.is_file():
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            asked += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def readahead_in_background(engine_dir) -> threading.Thread:
    thread = threading.Thread(target=readahead, args=(engine_dir,), name="engine-readahead",
                              daemon=True)
    thread.start()
    return thread
