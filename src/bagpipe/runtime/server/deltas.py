"""A data server's side of erasure coding: its write-backs' deltas, sent to its group's parity server."""

from __future__ import annotations

import functools
import logging
import queue
import threading

import numpy as np
import torch

from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.world import Epochs

log = logging.getLogger(__name__)

class DeltaSender:
    """A data server's deltas to its group's parity server. A write-back is acknowledged once its delta has
    arrived there (``send``'s future). A delta that failed to a re-formation of the RPC world is sent again. If
    the parity server is lost, write-backs are acknowledged without it and their deltas dropped: the group has
    no redundancy until a replacement has made the parity again (a loss in it meanwhile is the checkpoints' to
    cover), and the replacement reads this server's rows in the new RPC world, after every such write-back, so
    its parity holds them all."""

    def __init__(self, parity_name: str, *, member: int, epochs: Epochs, timeout: float) -> None:
        self.parity_name, self.member, self.epochs, self.timeout = parity_name, member, epochs, timeout
        self.unprotected = 0  # write-backs acknowledged while the parity server was lost
        self._lost_in: int | None = None  # the epoch in which the parity server was found lost
        self._lock = threading.Lock()
        self._failed: queue.Queue = queue.Queue()
        threading.Thread(target=self._recover, name="deltas", daemon=True).start()

    def send(self, space: int, local: np.ndarray, delta: np.ndarray, before: np.ndarray,
             version: int) -> torch.futures.Future:
        """The delta of a write-back (under the store's lock: a row's deltas leave in order); a future that
        completes when the write-back may be acknowledged."""
        answer: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._lost_in is not None and self.epochs.epoch == self._lost_in:  # no parity server to send to
                self.unprotected += 1
                answer.set_result(None)
                return answer
        self._send((space, self.member, torch.from_numpy(local), torch.from_numpy(delta.view(np.int32)),
                    torch.from_numpy(before), version), answer)
        return answer

    def _send(self, entry: tuple, answer: torch.futures.Future) -> None:
        sent_in = self.epochs.epoch
        sent = SERVER.parity_apply.call_async(self.parity_name, entry, timeout=self.timeout)
        sent.add_done_callback(functools.partial(self._arrived, entry, answer, sent_in))

    def _arrived(self, entry: tuple, answer: torch.futures.Future, sent_in: int, sent: torch.futures.Future) -> None:
        try:
            sent.value()
        except BaseException as err:  # noqa: BLE001 - judged on the recovery thread (it may wait)
            self._failed.put((entry, answer, sent_in, err))
            return
        answer.set_result(None)

    def _recover(self) -> None:
        while True:
            entry, answer, sent_in, err = self._failed.get()
            if not isinstance(err, RuntimeError):  # the parity server's own error (raised there): the write-back's
                answer.set_exception(err)
                continue
            with self._lock:
                lost = self._lost_in is not None and sent_in == self._lost_in
            if not lost and self.epochs.resend_after(sent_in):
                self._send(entry, answer)
                continue
            with self._lock:
                if self._lost_in is None or self._lost_in < sent_in:
                    self._lost_in = sent_in
                    log.warning("the parity server %s is lost (%s): write-backs are acknowledged without parity "
                                "until its replacement has made it again", self.parity_name, str(err).splitlines()[0])
                self.unprotected += 1
            answer.set_result(None)
