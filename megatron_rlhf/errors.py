"""The one exception type for bad input: the CLI prints its message on one line and exits non-zero."""


class UserError(Exception):
    """Input or configuration the user must fix; the message names what and where."""
