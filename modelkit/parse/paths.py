"""Rules for paths taken from untrusted files: archive member names and ONNX external-data locations.

A path read from a file may name only something inside the folder it came with: no NUL byte, no
absolute path (POSIX, Windows drive or UNC), no `..` component, and (for paths modelkit opens) no
symlink that resolves outside the folder. Both separators count, since a file made on one system is
read on another. The scanner reports a breach as a finding; converters refuse to read.
Standard library only (os.path, not pathlib: the scanner's start-up time).
"""
from __future__ import annotations

import os
import re
import stat

from modelkit.errors import ParseError

_SEPARATORS = re.compile(r"[\\/]")
_DRIVE = re.compile(r"[A-Za-z]:")


def member_problem(name: str) -> str | None:
    """Why an archive member name may not be extracted as given ('is an absolute path', ...), or None."""
    if "\x00" in name:
        return "contains a NUL byte"
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        return "is an absolute path"
    if ".." in _SEPARATORS.split(name):
        return "climbs out of the extraction folder with '..'"
    return None


def is_plain_name(name: str) -> bool:
    """A file name alone: no folder, no separator, not '.' or '..', no NUL, no drive."""
    return bool(name) and name not in (".", "..") and "\x00" not in name and not _SEPARATORS.search(name) \
        and not _DRIVE.match(name)


def plain_file(root: str, name: str) -> str | None:
    """`root`/`name` when `name` is a plain name of a regular file (not a symlink) in `root`, a folder's real
    path: inside the folder without resolving anything (one lstat); None where the full rules must decide."""
    if not is_plain_name(name):
        return None
    target = os.path.join(root, name)
    try:
        return target if stat.S_ISREG(os.lstat(target).st_mode) else None
    except OSError:
        return None


def plain_name_problem(name: str, directory: str) -> str | None:
    """Why `name` is not a plain file name inside `directory` (shards of a sharded checkpoint), or None."""
    if not is_plain_name(name):
        return "is not a plain file name"
    root = os.path.realpath(directory)
    if os.path.dirname(os.path.realpath(os.path.join(root, name))) != root:
        return "resolves (through a symlink) outside the folder"
    return None


def location_problem(location: str, directory: str | None) -> str | None:
    """Why an ONNX external-data location may not be read, or None when it stays in `directory`.

    Args:
        location: The `location` entry of a TensorProto's external_data.
        directory: The model's folder; None checks the text only (a member of an archive).
    """
    if not location:
        return "is empty"
    if "\x00" in location:
        return "contains a NUL byte"
    if os.path.isabs(location) or location.startswith(("/", "\\")) or _DRIVE.match(location):
        return "is an absolute path"
    if ".." in _SEPARATORS.split(location):
        return "climbs out of the model's folder with '..'"
    if directory is not None:
        root = os.path.realpath(directory)
        target = os.path.realpath(os.path.join(root, location.replace("\\", "/")))
        if os.path.commonpath([root, target]) != root:
            return "resolves (through a symlink) outside the model's folder"
    return None


def resolve_location(directory: str, location: str, *, what: str) -> str:
    """The real path of an external-data file: inside `directory`, and an existing regular file.

    Args:
        directory: The model's folder.
        location: The location read from the file.
        what: What names it, for messages ("initializer 'w'").

    Raises:
        ParseError: the location breaks a rule of `location_problem`, or names no regular file.
    """
    problem = location_problem(location, directory)
    if problem == "is empty" or problem == "contains a NUL byte":
        raise ParseError(f"{what} has external data without a location")
    if problem == "resolves (through a symlink) outside the model's folder":
        target = os.path.realpath(os.path.join(directory, location.replace("\\", "/")))
        raise ParseError(f"{what} has external data {location!r}, which links outside the model's folder "
                         f"to {target}; refusing to follow it")
    if problem is not None:
        raise ParseError(f"{what} has external data at {location!r}; only file names inside the model's folder "
                         "are allowed (no '..', no absolute paths), so it was not read")
    target = os.path.realpath(os.path.join(directory, location.replace("\\", "/")))
    if not os.path.isfile(target):
        raise ParseError(f"{what} has external data {location!r}, which is missing or not a file")
    return target


def read_capped(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The whole of a small structured file (`what`: "a protobuf", "a checkpoint index" ...), refusing one larger
    than `limit` before reading it: sizes are the file's claim, so they are checked before any allocation.

    Raises:
        ParseError: the file is larger than `limit` (OSError as the file system raises it).
    """
    size = os.stat(path).st_size
    if size > limit:
        raise ParseError(f"{os.path.basename(path)} is {size} bytes, over the {limit} that {what} may take; "
                         "refusing to read it", source=os.fspath(path))
    with open(path, "rb") as f:
        return f.read()
