"""Whether a CUDA graph capture may be under way, answered without a driver query where the caller knows.

`torch.cuda.is_current_stream_capturing()` asks the driver about the current stream. Alone it costs well under a
microsecond, but inside an eager pipeline iteration, with the launch queue busy, the queries add up to tens of
microseconds per block and microbatch (tools/gpu_probes/auto_host_probe.py), and every `--kernels auto` launch,
fused Linear and copy-engine send asks it. The runtime runs each eager iteration inside `eager_only()`: nothing
captures there, so `capturing()` answers False without asking. Outside it (graph captures, user code, tests)
`capturing()` asks torch as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_state = threading.local()


def capturing() -> bool:
    """Whether the current stream is capturing: False inside `eager_only()` on this thread, else torch's answer
    (False without CUDA)."""
    if getattr(_state, "eager", 0):
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def eager_only() -> Iterator[None]:
    """A region of this thread that never captures (an eager iteration): `capturing()` is False inside it. Nests;
    a capture begun inside it is a caller's error (torch.cuda.graph would see the kernels' eager choices)."""
    _state.eager = getattr(_state, "eager", 0) + 1
    try:
        yield
    finally:
        _state.eager -= 1
