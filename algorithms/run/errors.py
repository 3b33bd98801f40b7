"""The error every settings check raises: the message names the setting and says what to change."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting the user gave cannot work; the message names it and says what to change."""
