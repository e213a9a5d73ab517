"""The errors a user can fix by changing what they typed or installed.

The bottom layer of the package: it imports nothing from jaxpar, so every module (the
strategies below the loop included) can raise these without an import circle. The CLI prints
their message alone, without a traceback, and exits with status 2.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, a missing install or file: the message names the fix."""


class ConfigError(UserError, ValueError):
    """An option value that cannot work; the message names the option to change."""


class MeshError(ConfigError):
    """A mesh that cannot be built from the devices present (message names the fix)."""


class DataError(UserError):
    """A data set is missing or unreadable; the message says what to do."""


class ResultsError(UserError):
    """Results cannot be written or read; the message names the fix."""
