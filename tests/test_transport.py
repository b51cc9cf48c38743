"""The transport (runtime/transport.py): what a caller sees when a request cannot even be sent."""

from __future__ import annotations

import pytest

from bagpipe.runtime.endpoints import SERVER


def test_a_request_that_cannot_be_sent_is_a_failed_future_not_an_exception():
    """With no RPC agent (as while the world is re-formed around a replacement) call_async answers with a failed
    future: every caller re-sends a failed future after the re-formation; an exception raised at the call instead
    once failed a job whose oracle asked for a checkpoint part in that window."""
    future = SERVER.checkpoint_written.call_async("server0", (20,), timeout=1.0)
    assert future.done()
    with pytest.raises(RuntimeError):
        future.wait()
