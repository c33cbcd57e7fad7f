"""An adapter directory held open: every file is opened beneath its descriptor, never by a path string.

A tenant can name an adapter folder and control what is in it: a FIFO instead of a config (an
``open()`` that blocks forever), a device file, a symlink to another tenant's weights, or a folder
swapped for a symlink between a check and a read. :class:`AdapterDir` closes that class of holes:

- the directory is opened once and its descriptor held while the adapter is read, so the checks
  and the reads see the same directory even if the path is renamed or replaced meanwhile;
- each file is opened beneath it (``os.open(name, flags, dir_fd=fd)``) with ``O_NONBLOCK`` (opening a
  FIFO returns at once) and checked to be a regular file on the open descriptor (``S_ISREG``); the
  readers (:mod:`adapters.weights`) bound its size on that descriptor before reading anything;
- a *confined* directory (:meth:`AdapterDir.confined`, runtime loads under a tenant's adapter root)
  is walked from the root one component at a time with ``O_NOFOLLOW``, and its files are opened with
  ``O_NOFOLLOW`` too: no symlink is followed anywhere below the root. A *local* directory
  (:meth:`AdapterDir.local`: given by the operator, or a Hub snapshot, whose files are symlinks into
  the cache's ``blobs/``) follows symlinks, with every other check in place.

Error messages name the directory by its ``display`` name: for a confined directory the path the
caller gave, relative to its root, so no message shows where the root lies on the server.
"""

from __future__ import annotations

import os
import stat

from adapters.errors import AdapterNotFoundError, InvalidAdapterError, UnsafeAdapterError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


class PathEscapeError(UnsafeAdapterError):
    """A confined path leaves its root: absolute, ``..``, or a symbolic link on the way."""


def confined_parts(relative: str) -> list[str]:
    """The components of a path that must stay beneath its root; PathEscapeError for an absolute
    path, ``~``, a NUL byte, ``.`` or ``..`` components, or nothing at all. Decided on the string
    alone, so the answer says nothing about what exists on disk."""
    if not relative or os.path.isabs(relative) or relative.startswith("~") or "\x00" in relative:
        raise PathEscapeError(f"{relative!r} must be a relative path inside the adapter root")
    parts = [part for part in relative.replace(os.sep, "/").split("/") if part]
    if not parts or any(part in (".", "..") for part in parts):
        raise PathEscapeError(f"{relative!r} must name a folder inside the adapter root (no '.' or '..')")
    return parts


def file_version(st: os.stat_result) -> tuple:
    """What changes when an open file's content is written or truncated (not its ctime: that also
    changes when the file is renamed over or unlinked, which leaves the open file's content intact)."""
    return st.st_size, st.st_mtime_ns


class AdapterDir:
    """One adapter directory held open (use as a context manager; :meth:`close` releases it).

    Build it with :meth:`local` (follows symlinks) or :meth:`confined` (follows none below the root).
    """

    def __init__(self, fd: int, display: str, follow_links: bool) -> None:
        self.fd, self.display, self.follow_links = fd, display, follow_links

    @classmethod
    def local(cls, path: str) -> AdapterDir:
        """Open an operator's local directory (or a Hub snapshot): symlinks are followed.

        Raises:
            AdapterNotFoundError: it does not exist or is not a directory.
        """
        try:
            fd = os.open(os.path.expanduser(path), _DIR_FLAGS)
        except OSError as exc:
            raise AdapterNotFoundError(f"local directory {path} cannot be opened: {exc.strerror}") from exc
        return cls(fd, path, follow_links=True)

    @classmethod
    def confined(cls, root: str, relative: str) -> AdapterDir:
        """Open ``relative`` beneath ``root`` without following any symlink below ``root`` (the root
        itself is the operator's and may be a symlink).

        Raises:
            PathEscapeError: ``relative`` is not a plain relative path, or a component is a symlink.
            AdapterNotFoundError: a component is missing or not a directory (the same message for
                both, naming only ``relative``).
        """
        parts = confined_parts(relative)
        try:
            fd = os.open(root, _DIR_FLAGS)
        except OSError as exc:
            raise AdapterNotFoundError(f"{relative!r}: the adapter root cannot be opened") from exc
        try:
            for part in parts:
                child = _open_below(fd, part, relative)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, relative, follow_links=False)

    def close(self) -> None:
        """Release the directory descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AdapterDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a caller that forgot close() must not leak descriptors
        self.close()

    def has_file(self, name: str) -> bool:
        """True when ``name`` exists in the directory (in a confined one a symlink counts: opening it then
        says why)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=self.follow_links)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise InvalidAdapterError(f"{name} in {self.display}: {exc.strerror}") from exc
        return True

    def open_file(self, name: str) -> tuple[int, os.stat_result]:
        """An open descriptor of the regular file ``name`` and its stat; the caller closes the descriptor.

        Raises:
            AdapterNotFoundError: the file does not exist, or is not a regular file (a FIFO, a device,
                a directory: opening it never blocks, and it is refused on the open descriptor).
            PathEscapeError: it is a symlink in a confined directory.
            InvalidAdapterError: it cannot be opened.
        """
        flags = _FILE_FLAGS if self.follow_links else _FILE_FLAGS | os.O_NOFOLLOW
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError as exc:
            raise AdapterNotFoundError(f"{name} not found in {self.display}") from exc
        except OSError as exc:
            if not self.follow_links and _is_symlink(self.fd, name):
                raise PathEscapeError(f"{name} in {self.display} is a symbolic link; links are not followed "
                                      "under the adapter root") from exc
            raise InvalidAdapterError(f"{name} in {self.display} cannot be opened: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise InvalidAdapterError(f"{name} in {self.display} cannot be read: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise AdapterNotFoundError(f"{name} not found in {self.display}: it is not a regular file")
        return fd, st

    def path_of(self, name: str) -> str:
        """``name`` in this directory, for messages (relative to the root for a confined directory)."""
        return os.path.join(self.display, name)


def read_exactly(fd: int, before: os.stat_result, what: str, offset: int = 0) -> bytes:
    """Bytes ``offset`` to the end of the open file whose stat was ``before``; InvalidAdapterError when
    the file is not what ``before`` said by the end of the read (grown, shrunk or rewritten)."""
    want = before.st_size - offset
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            f.seek(offset)
            data = f.read(want + 1)  # one byte more: a file that grew shows as a longer read
        after = os.fstat(fd)
    except OSError as exc:
        raise InvalidAdapterError(f"{what} cannot be read: {exc.strerror}") from exc
    if len(data) != want or file_version(after) != file_version(before):
        raise InvalidAdapterError(f"{what} changed while it was read ({before.st_size} bytes before, "
                                  f"{offset + len(data)} read); replace adapter files atomically (rename)")
    return data


def _open_below(parent: int, part: str, relative: str) -> int:
    """Open directory ``part`` beneath ``parent`` without following a symlink."""
    try:
        return os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if _is_symlink(parent, part):
            raise PathEscapeError(f"{relative!r} must stay inside the adapter root (symbolic links are not "
                                  "followed)") from exc
        raise AdapterNotFoundError(f"no adapter folder {relative!r} under the adapter root") from exc


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
