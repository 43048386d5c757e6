"""Keep C++ chatter (MLIR converter statistics, XNNPACK banners) off the user's terminal.

TensorFlow's converter and the LiteRT runtime print straight to file
descriptor 2, below Python's sys.stderr, so only swapping the descriptor
itself silences them. What they printed is kept in a file, not thrown away.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def native_stderr_to(log_path: Path | None = None) -> Iterator[None]:
    """Send fd 2 to `log_path` (appending) or a discarded temp file for the duration.

    On an exception the captured text is replayed to the real stderr, so a
    failure is never explained only by a file the user does not know about.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "a+b") if log_path else tempfile.TemporaryFile() as sink:
        start = sink.seek(0, os.SEEK_END)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            sink.flush()
            sink.seek(start)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
