"""Files private to the daemon's user: its data folder holds every page (headers with prompt
token ids included), so no other user may read or list it.

Folders are 0700 and files 0600. The daemon sets the process umask to 077 while it runs
(`private_umask`; RocksDB creates its files with the umask's permissions, and keeps creating
them as it flushes and compacts), and at start-up makes private whatever an older version, or
another umask, left readable in its own folders (`make_private`). A folder shared on purpose
(`shared_folder`: sticky like /tmp, the root, a home folder) is never changed, nor walked.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
FOLDER_MODE = 0o700
FILE_MODE = 0o600


def private_umask() -> int:
    """Set the process umask to 077; returns the one it replaces (for `restore_umask`)."""
    return os.umask(PRIVATE_UMASK)


def restore_umask(previous: int) -> None:
    os.umask(previous)


def shared_folder(path: Path) -> bool:
    """A folder whose mode is not the daemon's to take: sticky (/tmp), /, or a home folder."""
    try:
        resolved = path.resolve()
        sticky = bool(resolved.stat().st_mode & stat.S_ISVTX)
    except OSError:
        return True
    return sticky or resolved == Path("/") or resolved == Path.home().resolve()


def private_folder(path: Path) -> None:
    """Create `path` (and missing parents) 0700, and make `path` itself 0700 if it exists
    (unless it is a `shared_folder`: then a warning)."""
    path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    if shared_folder(path):
        log.warning("%s is a shared folder: its mode is kept; give the daemon one of its own", path)
        return
    _chmod(path, FOLDER_MODE)


def make_private(folder: Path) -> int:
    """Make every folder under `folder` (itself included) 0700 and every other entry 0600, of
    those this user owns (symbolic links are not followed). Returns how many were changed."""
    changed = 0
    if not folder.is_dir() or folder.is_symlink() or shared_folder(folder):
        return 0
    changed += _chmod(folder, FOLDER_MODE)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            changed += _chmod(Path(root) / name, FOLDER_MODE)
        for name in files:
            changed += _chmod(Path(root) / name, FILE_MODE)
    if changed:
        log.info("made %d entries under %s private to this user", changed, folder)
    return changed


def _chmod(path: Path, mode: int) -> int:
    try:
        st = path.lstat()
    except OSError:
        return 0
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) == mode:
        return 0
    try:
        os.chmod(path, mode)
    except OSError as exc:
        log.warning("cannot make %s private: %s", path, exc)
        return 0
    return 1
