"""Errors a user can act on. Entry points print them as one line, without a traceback."""

EXIT_USER_ERROR = 2
"""Every rank exits with this, rank 0 printing one line, when the job's input is wrong (a bad
config, a drill with nothing to act on, a variant the guard does not check): restarting cannot
help, so launchers must not restart on it."""


class UserError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


class ConfigError(UserError):
    """The YAML configuration (or a value passed in code) is invalid."""


class UnsupportedVersionError(UserError):
    """The installed megatron-core is outside the range a patch target supports."""


class UnsupportedConfig(UserError):
    """A training configuration the guard cannot check yet; the message names the flag."""
