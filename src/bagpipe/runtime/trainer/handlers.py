"""What a trainer process answers (runtime/endpoints.py's ``TRAINER``): its progress, for a lost oracle's
replacement, and what a lost trainer's replacement asks of the lowest survivor (trainer/recovery.py)."""

from __future__ import annotations

import time

from bagpipe.runtime.trainer.recovery import HandedOver, Recovery
from bagpipe.runtime.trainer.runtime import TrainerRuntime


class TrainerHandlers:
    """What this trainer process answers, for its ``runtime``."""

    def __init__(self, runtime: TrainerRuntime) -> None:
        self.runtime = runtime

    def _recovery_for(self, trainer: int) -> Recovery:
        runtime = self.runtime
        deadline = time.monotonic() + 2 * runtime.world.timeout
        while True:
            recovery = runtime.lost.recovery
            if recovery is not None and recovery.trainer == trainer:
                return recovery
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {runtime.index} has no recovery for trainer {trainer}'s replacement")
            time.sleep(0.05)

    def recovery(self, trainer: int) -> Recovery:
        """The sums a replacement for ``trainer`` adds its shares to, and their iterations' inputs (without the
        state)."""
        recovery = self._recovery_for(trainer)
        plan = Recovery(trainer=trainer, epoch=recovery.epoch, sums=recovery.sums, kept=recovery.kept)
        plan.handed = None
        return plan

    def progress(self) -> dict:
        """How far this trainer is, for a lost oracle's replacement (``TrainerRuntime.progress``)."""
        return self.runtime.progress()

    def handed_over(self, trainer: int) -> HandedOver:
        """This trainer's state for ``trainer``'s replacement, once at an iteration boundary."""
        recovery = self._recovery_for(trainer)
        if not recovery.handed.wait(timeout=2 * self.runtime.world.timeout):
            raise TimeoutError(f"trainer {self.runtime.index} did not reach an iteration boundary to hand over its "
                               f"state")
        return recovery.state
