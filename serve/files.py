"""Files the server keeps in directories it does not trust (the state cache's, the stored responses'): written
atomically and privately, read only when they are regular files of a bounded size."""

from __future__ import annotations

import logging
import os
import stat
import threading

log = logging.getLogger(__name__)

TMP = ".tmp-"  # in the name of every temporary file `atomic_write` writes (their owners remove them at start)


def atomic_write(path: str, data: bytes):
  """Write to a temporary name (0600, never through a link), fsync, rename into place; on failure the
  temporary file is removed."""
  tmp = f"{path}{TMP}{os.getpid()}-{threading.get_ident()}"
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


def read_regular(path: str, limit: int, what: str = "such a file") -> bytes:
  """The bytes of a regular file, opened without following a link and without blocking (a FIFO); ValueError
  for anything but a regular file, or past `limit` bytes (`what`: the file's kind, for the message)."""
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise ValueError("not a regular file")
    if st.st_size > limit:
      raise ValueError(f"{st.st_size} bytes, more than the {limit} {what} may take")
    with os.fdopen(fd, "rb", closefd=False) as f:
      return f.read(st.st_size + 1)
  finally:
    os.close(fd)


def remove_temporaries(directory: str, owner: str):
  """Remove the temporary files an interrupted `atomic_write` left in `directory` (their names only; links
  are unlinked, not followed; directories are left alone). `owner` names the directory's user in the log."""
  for name in os.listdir(directory):
    if TMP in name:
      path = os.path.join(directory, name)
      try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
          os.unlink(path)
          log.info("%s: removed %s, left by an interrupted write", owner, name)
      except OSError as e:
        log.warning("%s: cannot remove %s (%s)", owner, name, e)
