"""The errors tfdist raises: bad input a user can fix, and a cluster that cannot go on."""


class ConfigError(ValueError):
    """Bad input: a config value, a flag, the cluster environment or a request.

    Each mistake is one line: what is wrong, what to do, and what was received. A config
    with several mistakes raises one error with a line for each (`problems`). The CLI
    prints each line after `tfdist: error: ` and exits with status 2.

    Example:

    >>> raise ConfigError(
    ...     "accumulation_steps must be an integer >= 1. Received: accumulation_steps=0")
    Traceback (most recent call last):
    tfdist.errors.ConfigError: accumulation_steps must be ...
    """

    def __init__(self, *args: object):
        super().__init__(*args)
        self.problems: list[str] = str(self).splitlines() or [str(self)]  # one line each

    @classmethod
    def of(cls, problems: "list[str]") -> "ConfigError":
        """One error for several mistakes, a line each."""
        return cls("\n".join(problems))


class ClusterError(RuntimeError):
    """A task the run cannot go on without has failed (a parameter server, for one).

    The message is one line: which task, what happened, what to do. The CLI
    prints it alone and exits with status 1.

    Example:

    >>> raise ClusterError("parameter server ps:0 (127.0.0.1:2223) is unreachable ...")
    Traceback (most recent call last):
    tfdist.errors.ClusterError: parameter server ps:0 ...
    """


# TensorFlow is an extra of the package (its CPU and GPU builds have different names).
MISSING_TENSORFLOW = ("TensorFlow is not installed in this environment; install the release "
                      "tfdist is built for: pip install 'tensorflow-cpu>=2.21,<2.22' (or "
                      "'tensorflow[and-cuda]>=2.21,<2.22' on NVIDIA GPUs)")


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an error's message, at most `limit` characters: what a one-line
    report quotes of an upstream error ("" for an empty message).

    Args:
        error: The exception to quote.
        limit: The most characters kept.

    Example:

    >>> first_line(ValueError("shape mismatch\\n  at layer dense"))
    'shape mismatch'
    """
    return (str(error).strip().splitlines() or [""])[0][:limit]
