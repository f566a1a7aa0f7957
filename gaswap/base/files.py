"""Reading and writing the files a user hands gaswap or gets from it. No torch here.

Reading is bounded: a file larger than its limit is refused before it is read, and YAML is parsed with safe
types only, no aliases (an alias "bomb" of a few hundred bytes can expand to gigabytes) and no key given
twice. Writing goes through a temporary file and a rename, so a reader never sees half a file.
"""
from __future__ import annotations

import csv
import io
import os
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from gaswap.base.errors import GaswapError

MiB = 2**20


class UnreadableFile(GaswapError, ValueError):
    """A file that cannot be read as asked; str() is one line naming the file."""


def read_text(path: str | Path, limit: int) -> str:
    """The UTF-8 text of `path`, refusing a missing file, a folder, or a file over `limit` bytes (before reading)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UnreadableFile(f"{path}: no such file") from None
    except OSError as err:
        raise UnreadableFile(f"{path}: cannot read ({err.strerror or err})") from None
    if path.is_dir():
        raise UnreadableFile(f"{path}: is a folder, not a file")
    if size > limit:
        raise UnreadableFile(f"{path}: {size} bytes, more than the {limit} bytes this file may have")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # the file may have grown since stat()
    except OSError as err:
        raise UnreadableFile(f"{path}: cannot read ({err.strerror or err})") from None
    if len(data) > limit:
        raise UnreadableFile(f"{path}: more than the {limit} bytes this file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason})") from None


class _StrictLoader(yaml.SafeLoader):
    """yaml's SafeLoader refusing aliases (`*name`) and a key given twice in one mapping."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} is not allowed (gaswap files "
                                                          f"take no anchors or aliases)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                        key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path, limit: int) -> Any:
    """The YAML document in `path` (see `read_text` for the limit), safe types only, no aliases, no key twice."""
    text = read_text(path, limit)
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        raise UnreadableFile(f"{path}: {line}invalid YAML: {problem}") from None
    except RecursionError:
        raise UnreadableFile(f"{path}: invalid YAML: nested too deeply") from None


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, fsync, and a rename."""
    with replacing(path) as f:
        f.write(text)


@contextmanager
def replacing(path: str | Path, *, binary: bool = False):
    """A new file, open for writing, that replaces `path` when the block ends: written as a temporary file in
    the same folder, flushed, fsynced and renamed over `path`, so a reader (or a process killed at any moment)
    finds the old file or the new one, whole. On an error the temporary file goes and `path` is untouched;
    an OSError that names no file names `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise _naming(err, path) from None
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes owner-only files; give the usual permissions
        os.replace(tmp, path)
    except BaseException as err:
        with suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise _naming(err, path) from None
        raise


def _naming(err: OSError, path: Path) -> OSError:
    """`err`, or the same error naming `path` when it names no file (a full disk's ENOSPC names none)."""
    if err.filename is not None:
        return err
    return OSError(err.errno, err.strerror or str(err), str(path))


def umask() -> int:
    """The process's umask (read without changing it for longer than a moment)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def csv_text(rows, columns) -> str:
    """`rows` (dicts keyed by `columns`) as CSV text with a header line; None is written as an empty cell."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    return out.getvalue()
