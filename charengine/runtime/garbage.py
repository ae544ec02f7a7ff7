"""The cyclic garbage collector in a process that serves session after session.

A session's peer connection, its tracks and video encoder, and its pipeline are held in
reference cycles (the WebRTC library's and the pipeline's own), so only a pass of the cyclic
collector frees them, with the native threads and buffers of the encoder. Left to the
collector's own schedule in a process that holds an engine's hundreds of thousands of
objects, that pass came rarely: sessions stayed allocated one after another, each with its
encoder's threads, and the full pass that finally came held every thread while it scanned
the whole process, the live sessions' pacers included (docs/RELIABILITY.md, "Sessions one
after another").

    freeze_start_up()        once the worker is ready: what start-up made (the engine,
                             torch, the libraries) leaves the collector's generations, so a
                             full pass scans only what was made since
    collect_after_session()  a session has ended: a full pass COLLECT_DELAY_S later, once
                             its tasks have unwound and nothing reachable holds it
"""

from __future__ import annotations

import gc
import threading

# after a session ends, before its cycles are collected: its watchers' cancellations and its
# peer connection's close run on the event loop first (well under this)
COLLECT_DELAY_S = 1.0


def freeze_start_up() -> None:
    """Collect what start-up left, then move every object there is now to the collector's
    permanent generation (gc.freeze): later passes never scan them."""
    gc.collect()
    gc.freeze()


def collect_after_session() -> threading.Timer:
    """A full collection COLLECT_DELAY_S from now, on a thread of its own (returned)."""
    timer = threading.Timer(COLLECT_DELAY_S, gc.collect)
    timer.daemon = True
    timer.start()
    return timer
