"""The one exception type for bad input: the CLI prints its message on one line and exits non-zero;
and the exit codes a batch script can tell apart."""

EXIT_USER_ERROR = 2
"""Bad input or configuration (the message names what and where); resubmitting will not help."""
EXIT_STOPPED = 75
"""Stopped cleanly before the end (a stop signal or ``trainer.stop_at``), a checkpoint written:
run the same command again to continue. (75 is ``EX_TEMPFAIL`` of sysexits.h.)"""


class UserError(Exception):
    """Input or configuration the user must fix; the message names what and where."""


class RunStopped(Exception):
    """A run stopped at a step boundary and saved: the CLI exits with :data:`EXIT_STOPPED`."""

    def __init__(self, step: int, reason: str, where: str):
        super().__init__(f"stopped at step {step} ({reason}); checkpoint in {where}; run the "
                         "same command again to resume")
        self.step = step
