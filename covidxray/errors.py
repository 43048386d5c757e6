"""Errors a user can act on, and telling them apart from the user stopping a run.

The CLI prints a UserError as one clear message, never a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Something in the user's input, files or config; the message says which and what to do."""


def reraise_interrupt(err: BaseException) -> None:
    """Raise the KeyboardInterrupt chained inside `err`, if any; otherwise return.

    For the catch-alls that turn a decoder's failure into "this file is unreadable". A Ctrl-C that lands while a C
    function runs (cv2.imread calling os.fspath, pydicom's numpy) can come out as a SystemError ("... returned a
    result with an exception set") whose cause is the KeyboardInterrupt: that is the user stopping the run, and
    reporting it as one bad file would let the run go on through every later file.
    """
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            raise link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
