"""Errors a user can act on. The CLI prints these as one clear message, never a traceback."""


class UserError(Exception):
    """Something in the user's input, files or config; the message says which and what to do."""
