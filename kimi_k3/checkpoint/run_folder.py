"""The output folder of a training job: one job at a time, durable atomic publication, recovery after a kill.

A job holds an exclusive ``flock`` on ``<output_dir>/.kimi-k3.lock`` while it runs. The kernel drops the lock when
the process dies, so a killed job never leaves the folder locked; the holder's pid, host and start time are written
into the file so that a second job can name it. Folders are written under unique hidden staging names, fsync'ed
(files, then directories) and renamed into place, so neither a crash nor a power loss publishes a partial folder.
"""

import ctypes
import errno
import fcntl
import functools
import json
import os
import re
import resource
import shutil
import socket
import stat
import sys
import tempfile
import time
import uuid
from pathlib import Path

LOCK_NAME = ".kimi-k3.lock"
# Trainer state a checkpoint folder holds besides the model; none of it belongs in a published or converted model.
TRAINER_STATE_PATTERNS = ["optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "trainer_state.json",
                          "training_args.bin", "batch_size.json", "run_settings.json"]
STAGING_PREFIX = ".staging-"
REPLACED_SUFFIX = ".replaced"


class FolderBusyError(ValueError):
    """Another job holds the output folder."""


class FolderNotWritableError(ValueError):
    """The output folder (or the folder it would be created in) cannot be written."""


# ---------------------------------------------------------------------------------------------------------------------
# One job per folder
# ---------------------------------------------------------------------------------------------------------------------
class OutputFolderLock:
    """Exclusive, non-blocking lock of ``folder`` for the life of one job. ``release`` removes the lock file, and the
    folder too when the lock created it and nothing else was written (a job stopped by bad input leaves no trace).
    (Not ``filelock.FileLock``: the lock file here carries its holder's pid, host and start time for the second job's
    message, and the folders it created go with it; filelock's 3.x releases truncate the file on every open.)"""

    def __init__(self, folder: str | Path, name: str = LOCK_NAME):
        self.folder = Path(folder)
        self.path = self.folder / name
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> "OutputFolderLock":
        missing = [self.folder, *self.folder.parents]
        self._created = missing[: next(i for i, path in enumerate(missing) if path.exists())]
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FolderBusyError(busy_message(self.folder, read_holder(self.path))) from None
            # The previous holder may have removed the file between our open and our lock: lock the live file.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked, so no other job can have locked this file
        except OSError as error:  # the folder became read-only: the kernel still drops the lock at close
            print(f"kimi-k3-train: warning: could not remove {self.path} ({os.strerror(error.errno)}); the next job "
                  "takes it over", file=sys.stderr)
        os.close(self._fd)
        self._fd = None
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # not empty: this job wrote something there
                break

    def __enter__(self) -> "OutputFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def open_lock_file(path: Path) -> int:
    """Open (or create) the lock file itself, never the target of a link planted in its place: its content is
    overwritten with this job's pid record."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise FolderNotWritableError(planted_link_message(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FolderNotWritableError(f"--output_dir {path.parent}: {path.name} is not a regular file; remove it")
    return fd


def planted_link_message(path: Path) -> str:
    return (
        f"--output_dir {path.parent}: {path.name} is a symbolic link (to {os.readlink(path)}); the job never writes "
        "through a link: remove it"
    )


def write_new_file(path: Path, content: bytes) -> None:
    """Write ``content`` into a file that did not exist: no link planted at ``path`` is followed, nothing is
    overwritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise FolderNotWritableError(f"{path} already exists (a file or a link another process put there)") from None
    with os.fdopen(fd, "wb") as file:
        file.write(content)


def read_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, running since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a job that has not yet written its pid"


def busy_message(folder: Path, holder: str) -> str:
    return f"--output_dir {folder} is in use by another job ({holder}); wait for it or choose another --output_dir"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Checks before anything is written
# ---------------------------------------------------------------------------------------------------------------------
def check_output_folder(folder: str | Path) -> None:
    """A job's output folder: not inside another job's folders (`check_not_nested`, first, since the writability
    probe creates a file), and writable."""
    check_not_nested(folder)
    check_writable(folder)


def check_writable(folder: str | Path) -> None:
    """Create and remove a probe file in ``folder``, or in the nearest existing parent it would be created in."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise FolderNotWritableError(f"--output_dir {folder}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".kimi-k3-probe-")
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise FolderNotWritableError(f"--output_dir {folder}: cannot write in {existing} ({reason})") from None
    os.close(fd)
    os.unlink(probe)


# A job's folders that its saves replace or delete whole: the final model and the rotated checkpoints.
REPLACED_FOLDER = re.compile(r"model|checkpoint-\d+")


def check_not_nested(folder: str | Path) -> None:
    """Refuse an output folder inside another job's ``model/`` or ``checkpoint-N/``: that job's final save replaces
    its ``model/`` and its checkpoint rotation deletes old checkpoints, and with them this job's files. Such a folder
    is recognised by the job's lock beside it (a running job) or by what a saved one holds."""
    folder = Path(os.path.realpath(folder))
    for part in (folder, *folder.parents):
        if not REPLACED_FOLDER.fullmatch(part.name):
            continue
        saved = any((part / name).is_file() for name in ("config.json", "trainer_state.json"))
        if saved or (part.parent / LOCK_NAME).exists():
            raise FolderNotWritableError(
                f"--output_dir {folder} lies inside {part}, which the job writing {part.parent} replaces or deletes "
                "on its next save; choose a folder outside it"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Durable, atomic publication
# ---------------------------------------------------------------------------------------------------------------------
def staging_name(name: str, tag: str) -> str:
    """Hidden, unique per job: two jobs (or a killed job's leftovers) never share a staging folder."""
    return f"{STAGING_PREFIX}{name}-{tag}"


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, then every directory, to stable storage."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(Path(root) / name, os.O_RDONLY)
        _fsync(Path(root), os.O_RDONLY | os.O_DIRECTORY)


def fsync_dir(folder: Path) -> None:
    _fsync(folder, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(staged: Path, target: Path) -> None:
    """Publish a completely written folder as ``target``; an existing ``target`` stays whole until it is replaced.

    ``staged`` lives under ``target``'s parent, on one filesystem: the two folders are swapped in one step where
    Linux can (`exchange_paths`), else renamed twice, each rename atomic. Between the two renames the old folder
    sits complete under ``.<name>.replaced``; `recover_replacements` restores it if the job dies
    there. Contents are fsync'ed before the first rename and the parent directory after the last.
    """
    fsync_tree(staged)
    if target.is_dir() and exchange_paths(staged, target):
        fsync_dir(target.parent)
        shutil.rmtree(staged, ignore_errors=True)  # now the old folder, under the staging name recovery removes
        return
    backup = replaced_name(target)
    shutil.rmtree(backup, ignore_errors=True)
    if target.exists():
        os.rename(target, backup)
    os.rename(staged, target)
    fsync_dir(target.parent)
    shutil.rmtree(backup, ignore_errors=True)


# renameat2(2)'s flag that swaps two paths in one step (Linux 3.15, glibc 2.28).
RENAME_EXCHANGE = 2


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two folders atomically with Linux's ``renameat2(RENAME_EXCHANGE)``, so that a reader never finds
    ``second`` missing; False where the system or the filesystem cannot (then two renames do it)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):  # no such call, or not on this filesystem
        return False
    raise OSError(error, os.strerror(error), str(second))


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def replaced_name(target: Path) -> Path:
    return target.with_name(f".{target.name}{REPLACED_SUFFIX}")


def recover_replacements(folder: Path) -> list[str]:
    """Undo what a killed job left half done: put back a folder caught between the two renames of `replace_folder`
    and remove staging folders. Only the lock holder may call this. Returns what was restored."""
    restored = []
    if not folder.is_dir():
        return restored
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") and path.name.endswith(REPLACED_SUFFIX) and path.is_dir():
            target = folder / path.name[1 : -len(REPLACED_SUFFIX)]
            if target.exists():
                shutil.rmtree(path)
            else:
                os.rename(path, target)
                restored.append(target.name)
        elif path.name.startswith(STAGING_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
    if restored:
        fsync_dir(folder)
    return restored


def remove_stale_staging(target: Path) -> list[str]:
    """Remove the staging folders of ``target`` that killed writers left beside it; only the holder of ``target``'s
    lock may call this. Returns their names."""
    stale = sorted(path for path in target.parent.glob(f"{STAGING_PREFIX}{target.name}-*")
                   if path.is_dir() and len(path.name) == len(staging_name(target.name, new_tag())))
    for path in stale:
        shutil.rmtree(path)
    return [path.name for path in stale]


def size_limit_reached(error: BaseException) -> bool:
    """EFBIG, or a writer's out-of-room report while a file size limit (``ulimit -f``) is set: the disk may have room."""
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return True
    return _writer_out_of_room(str(error)) and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def _writer_out_of_room(text: str) -> bool:
    # torch.save's zip writer says "unexpected pos" / "file write failed"; safetensors passes on the OS's words
    # ("File too large (os error 27)") without an errno.
    return any(words in text for words in ("unexpected pos", "file write failed", "File too large"))


def write_failure_cause(error: BaseException) -> str:
    """Why a write failed, as the error table words it, or ``""`` when it is neither a size limit nor a full disk."""
    if size_limit_reached(error):
        return " (the file size limit, ulimit -f, was reached)"
    return " (the disk is full)" if is_disk_full(error) else ""


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when a writer (torch.save's zip writer, safetensors) reports it in its own words."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left" in str(error) or _writer_out_of_room(str(error))
