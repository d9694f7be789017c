"""The one exception type that reaches users as a one-line message (the CLI exits with code 2)."""


class RetrofitError(Exception):
    """Bad user input or an unsupported model: the message is shown as is, without a traceback."""
