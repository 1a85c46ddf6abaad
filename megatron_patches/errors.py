"""Errors a user can act on. Entry points print them as one line, without a traceback."""


class UserError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


class ConfigError(UserError):
    """The YAML configuration (or a value passed in code) is invalid."""


class UnsupportedVersionError(UserError):
    """The installed megatron-core is outside the range a patch target supports."""


class UnsupportedConfig(UserError):
    """A training configuration the guard cannot check yet; the message names the flag."""
