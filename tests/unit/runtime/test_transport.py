"""The transport (runtime/transport.py): what a caller sees when a request cannot even be sent, and how it tells a
peer's process ending from an error that peer's handler raised."""

from __future__ import annotations

import pytest

from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.transport import PEER_GONE, RAISED_BY_HANDLER, peer_gone, raised_by_handler


def test_a_request_that_cannot_be_sent_is_a_failed_future_not_an_exception():
    """With no RPC agent (as while the world is re-formed around a replacement) call_async answers with a failed
    future: every caller re-sends a failed future after the re-formation; an exception raised at the call instead
    once failed a job whose oracle asked for a checkpoint part in that window."""
    future = SERVER.checkpoint_written.call_async("server0", (20,), timeout=1.0)
    assert future.done()
    with pytest.raises(RuntimeError):
        future.wait()


def test_a_peer_that_ended_is_told_from_an_error_its_handler_raised():
    """As torch words them (gloo, TensorPipe, a TCPStore client; an RPC handler's error re-raised at the caller)."""
    ended = ["[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54493",
             "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)",
             "Connection reset by peer", "RPCErr:1:Broken pipe"]
    raised = "On WorkerInfo(id=3, name=server0):\nValueError('no row 12 in table 2')\nTraceback ..."
    assert all(peer_gone(RuntimeError(text)) for text in ended)
    assert not peer_gone(RuntimeError(raised)) and not peer_gone(ValueError(ended[0]))
    assert raised_by_handler(RuntimeError(raised)) and not any(raised_by_handler(RuntimeError(t)) for t in ended)


def test_torch_error_texts_are_read_in_the_transport_only():
    """No other module of the package matches torch's error messages: a torch release that words them otherwise
    changes one place."""
    from pathlib import Path

    import bagpipe

    package = Path(bagpipe.__file__).parent
    texts = [*PEER_GONE, RAISED_BY_HANDLER]
    reading = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if path.name != "transport.py" and any(text in path.read_text() for text in texts))
    assert reading == []
