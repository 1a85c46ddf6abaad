"""Errors a user can act on. Entry points print them as one line, without a traceback."""

import time
from typing import NoReturn

EXIT_USER_ERROR = 2
"""Every rank exits with this, rank 0 printing one line, when the job's input is wrong (a bad
config, a drill with nothing to act on, a variant the guard does not check): restarting cannot
help, so launchers must not restart on it."""


REFUSAL_GRACE_S = 3.0
"""How long the other ranks wait before they exit on a refusal, so that rank 0's one line is out
before a launcher that sees the first exit tears the job down (torchrun stops the remaining
workers at once: measured here, rank 0 was stopped before it printed)."""


def exit_refused(rank: int) -> NoReturn:
    """End this rank with :data:`EXIT_USER_ERROR` once rank 0 has said why (the caller prints the
    line on rank 0 first); the other ranks wait :data:`REFUSAL_GRACE_S` before they go."""
    if rank != 0:
        time.sleep(REFUSAL_GRACE_S)
    raise SystemExit(EXIT_USER_ERROR)


class UserError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


class ConfigError(UserError):
    """The YAML configuration (or a value passed in code) is invalid."""


class UnsupportedVersionError(UserError):
    """The installed megatron-core is outside the range a patch target supports."""


class UnsupportedConfig(UserError):
    """A training configuration the guard cannot check yet; the message names the flag."""
