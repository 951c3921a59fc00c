"""The one error type tfdist raises for input a user can fix."""


class ConfigError(ValueError):
    """Bad input: a config value, a flag, the cluster environment or a request.

    The message is one line: what is wrong, what to do, and what was received.
    The CLI prints it alone and exits with status 2.

    Example:

    >>> raise ConfigError(
    ...     "accumulation_steps must be an integer >= 1. Received: accumulation_steps=0")
    Traceback (most recent call last):
    tfdist.errors.ConfigError: accumulation_steps must be ...
    """
