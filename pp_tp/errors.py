"""The one error type users see for bad input: one line naming the key, the value and the fix."""


class ConfigError(ValueError):
    """Raised before any process group work when a config value, argument or shape is invalid."""
