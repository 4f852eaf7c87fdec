"""Errors the user can act on.

Anything raised as :class:`UagError` is printed by the CLI as one line on stderr
(no traceback unless ``UAG_DEBUG=1``); anything else is a bug and keeps its traceback.
"""


class UagError(Exception):
    """A problem with the user's input or environment, explained in one line."""
