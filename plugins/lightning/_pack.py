"""One file per Lightning checkpoint: the *pack* (the layout of full-dict checkpoints, route ``io``).

Lightning and its users treat a ``.ckpt`` path as one plain file: ``os.listdir`` / ``glob`` /
fsspec ``ls`` of a checkpoint folder show only the ``.ckpt`` names, ``os.path.isfile`` holds,
``os.remove`` / ``fs.rm`` / ``shutil.copy`` / ``os.symlink`` (``save_last="link"``) act on the whole
checkpoint, and ``ModelCheckpoint``'s version counter checks ``exists``. So the unickpt checkpoint
of a path ``P`` lives *inside* ``P``::

    P = a torch.save zip archive: data.pkl, data/<key> (each tensor's bytes), .unickpt/ (the members)

so that ``torch.load(P)`` reads the checkpoint dict as from Lightning's own file (:mod:`._torchzip`).
The members are the files of one committed unickpt checkpoint directory (``metadata.json``,
``data/0_0.bin``, ``objects/...``); the index maps each member name to ``[offset, size]``, or a data
file to the parts of the ``data/<key>`` records it is made of (each tensor byte is stored once). Format
1 (``MAGIC | members | index | footer``, written before) is still read. A save
writes the unickpt checkpoint into process memory (``memory://``, see :func:`staging_dir`), and
after its commit the pack is written to an unnamed file in ``P``'s folder, named in a hidden folder
beside that folder and renamed over ``P`` atomically (object stores: one PUT): a listing of ``P``'s
folder shows ``P`` and nothing else at every moment (:func:`_place`).
A reader opens ``P`` once and reads every member through that one handle (:func:`open_pack`), so a
concurrent replacement of ``P`` is never seen half-way: it reads the old file or the new one.

Until the first save of ``P`` has committed, ``P`` is a *placeholder* (:func:`write_placeholder`):
a small JSON file naming the writing process, so that ``P`` exists as soon as the save call
returns. Readers wait for the save (in-process: the in-flight registry of ``io``; another process:
until ``P`` is replaced, or its writer is gone).
"""
from __future__ import annotations

import bisect
import errno
import json
import os
import socket
import struct
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import fsspec
from fsspec import AbstractFileSystem

from unickpt import IntegrityError, ext

from . import _torchzip

__all__ = ["MAGIC", "PENDING_FORMAT", "PROTOCOL", "is_pack", "kind", "write_pack", "open_pack", "staging_dir",
           "write_placeholder", "read_placeholder", "placeholder_alive", "wait_placeholder", "temp_name",
           "remove_path", "PackFileSystem"]

MAGIC = b"UNICKPT-LPACK-1\n"  # 16 bytes, first and last bytes of a pack
_FOOTER = struct.Struct("<QQ")  # index offset, index length (then MAGIC)
PENDING_FORMAT = "unickpt-lightning-pending"
PROTOCOL = "unickptpack"
_MAX_PLACEHOLDER = 1 << 12
_KEEP_VERIFIED = 64 << 20  # members up to this size are kept once their CRC-32 is checked (read once)


def temp_name(path: str) -> str:
    """A hidden temporary sibling of ``path`` that Lightning's scans never parse (no ``.ckpt``, no
    part of ``path``'s name, so ``hpc_ckpt_<n>`` / ``last*`` / version patterns do not match): the
    last resort of :func:`_place`, where no folder outside ``path``'s can hold the temporary file."""
    parent = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."
    return f"{parent}/.unickpt-tmp-{uuid.uuid4().hex}"


def staging_dir() -> str:
    """A fresh in-memory directory for one save (fsspec ``memory://``, this process only)."""
    return f"memory://unickpt-lightning/{os.getpid()}-{uuid.uuid4().hex}"


def _local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _strip_file(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def is_pack(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes: 64 are enough) starts a pack of either format."""
    return head.startswith(MAGIC) or _torchzip.is_pack_head(head)


def kind(path: str, options: dict | None = None) -> str | None:
    """What ``path`` holds: ``"pack"``, ``"pending"`` (a placeholder), ``"pointer"`` (a small JSON
    file claiming the earlier pointer layout, :mod:`._pointers`), ``"missing"``, ``"dir"``, or None (a
    file of another format, e.g. a ``torch.save`` checkpoint)."""
    try:
        if _local(path):
            p = _strip_file(path)
            if not os.path.exists(p):
                return "missing"
            if os.path.isdir(p):
                return "dir"
            with open(p, "rb") as f:
                head = f.read(_MAX_PLACEHOLDER + 1)
        else:
            fs, _ = fsspec.core.url_to_fs(path, **(options or {}))
            if not fs.exists(path):
                return "missing"
            if fs.isdir(path):
                return "dir"
            with fs.open(path, "rb") as f:
                head = f.read(_MAX_PLACEHOLDER + 1)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return None
    if is_pack(head):
        return "pack"
    if len(head) > _MAX_PLACEHOLDER or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    if doc.get("format") == PENDING_FORMAT:
        return "pending"
    if doc.get("format") == "unickpt-lightning":
        return "pointer"
    return None


def _write_local_atomic(path: str, chunks: list) -> None:
    """Write ``chunks`` to local ``path`` atomically, so that a listing of ``path``'s folder never
    shows any name but ``path``'s own. The bytes go to an unnamed file (``O_TMPFILE``) that becomes
    ``path`` by a link when ``path`` is new, else is linked into a hidden folder outside ``path``'s
    folder and renamed over ``path`` (:func:`_place`); where no unnamed file can be made or linked,
    the bytes are written under that hidden folder's name instead."""
    final = os.path.abspath(_strip_file(path))
    parent = os.path.dirname(final)
    named = False
    fd = -1
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(parent, os.O_TMPFILE | os.O_WRONLY, 0o644)
        except OSError:
            fd = -1
    if fd >= 0:
        try:
            _write_all(fd, chunks)
            try:
                _link_fd(fd, final)  # a new path: it appears whole, under its own name
                named = True
            except FileExistsError:
                named = _try(lambda: _place(final, lambda tmp: _link_fd(fd, tmp)))
            except OSError:
                pass
        finally:
            os.close(fd)
    if not named:
        _place(final, lambda tmp: _write_file(tmp, chunks))
    _fsync_dir(parent)


def _try(fn: Callable[[], None]) -> bool:
    """Run ``fn``; False if it raised an OSError (True otherwise)."""
    try:
        fn()
        return True
    except OSError:
        return False


def _link_fd(fd: int, dst: str) -> None:
    """Give the unnamed file ``fd`` (``O_TMPFILE``) the new name ``dst``: ``linkat`` through
    ``/proc/self/fd``, else ``linkat(fd, "", AT_EMPTY_PATH)`` (where ``/proc``'s magic links do
    not cross mounts). Raises FileExistsError if ``dst`` exists, another OSError if neither works."""
    try:
        os.link(f"/proc/self/fd/{fd}", dst, follow_symlinks=True)
        return
    except FileExistsError:
        raise
    except OSError as e:
        first = e
    import ctypes

    try:
        linkat = ctypes.CDLL(None, use_errno=True).linkat
    except (OSError, AttributeError):
        raise first from None
    if linkat(fd, b"", -100, os.fsencode(dst), 0x1000) != 0:  # AT_FDCWD, AT_EMPTY_PATH
        err = ctypes.get_errno()
        raise (FileExistsError if err == errno.EEXIST else OSError)(err, os.strerror(err), dst)


def _write_all(fd: int, chunks: list) -> None:
    """Write every chunk (bytes-like) to ``fd`` in order, then fsync it."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)


def _write_file(path: str, chunks: list) -> None:
    """Create ``path`` (it must not exist) holding ``chunks``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, chunks)
    finally:
        os.close(fd)


def _place(final: str, make: Callable[[str], None]) -> None:
    """Replace ``final`` atomically by the file ``make(tmp)`` creates at a temporary name ``tmp``.

    ``tmp`` lies in a fresh hidden folder beside ``final``'s folder (``<outer>/.unickpt-tmp-<hex>/``,
    removed right after the rename), so no listing of ``final``'s folder (``os.listdir``, ``glob``,
    fsspec ``ls``: Lightning's and its users') ever shows it, even while a save is in flight. Where
    that folder cannot be made (``final``'s folder is a file system's root, its parent is not
    writable or lies on another file system, or a bind mount refuses the rename), ``tmp`` is a
    hidden name in ``final``'s folder (:func:`temp_name`: no ``.ckpt`` in it), visible from its
    creation to the rename. Raises what ``make`` or the rename raise."""
    side = _side_dir(os.path.dirname(final))
    try:
        if side is not None:
            tmp = f"{side}/pack"
            try:
                make(tmp)
            except BaseException:
                _remove_quietly(tmp)
                raise
            try:
                os.replace(tmp, final)
                return
            except OSError as e:
                _remove_quietly(tmp)
                if e.errno != errno.EXDEV:  # a bind mount: one device, no rename across it
                    raise
        tmp = temp_name(final)
        try:
            make(tmp)
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
    finally:
        if side is not None:
            try:
                os.rmdir(side)
            except OSError:
                pass


def _side_dir(parent: str) -> str | None:
    """A fresh hidden folder in the parent of folder ``parent``, on ``parent``'s file system, or None."""
    outer = os.path.dirname(parent)
    if not outer or outer == parent:
        return None
    side = f"{outer}/.unickpt-tmp-{uuid.uuid4().hex}"
    try:
        os.mkdir(side, 0o700)
    except OSError:
        return None
    try:
        if os.stat(side).st_dev == os.stat(parent).st_dev:
            return side
    except OSError:
        pass
    try:
        os.rmdir(side)
    except OSError:
        pass
    return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _fsync_dir(parent: str) -> None:
    dfd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_atomic(path: str, chunks: list, options: dict | None) -> None:
    if _local(path):
        os.makedirs(os.path.dirname(os.path.abspath(_strip_file(path))), exist_ok=True)
        _write_local_atomic(path, chunks)
        return
    fs, _ = fsspec.core.url_to_fs(path, **(options or {}))
    with fs.open(path, "wb") as f:  # one object: atomic on object stores
        for chunk in chunks:
            f.write(chunk)


def write_pack(path: str, staged: str, options: dict | None, extra: dict | None = None,
               torch_pickle: _torchzip.TorchPickle | None = None) -> int:
    """Pack the committed unickpt checkpoint directory ``staged`` (``memory://``) into ``path``,
    atomically replacing what ``path`` held: a ``torch.save`` zip archive (:mod:`._torchzip`) that
    ``torch.load`` reads as the checkpoint dict whose ``data.pkl`` is ``torch_pickle`` (None: no
    ``data.pkl``, ``torch.load`` refuses the file), each tensor's bytes stored once. Returns the pack's
    size in bytes."""
    mem = fsspec.filesystem("memory")
    root = mem._strip_protocol(staged).rstrip("/")
    # listed in memory directly, not through the storage layer (whose faults are the user's storage's, not
    # this process's staging area's); the commit marker last, as it is written last; no writer record
    marker, writer = ext.CheckpointDir.MARKER_NAME, ext.CheckpointDir.WRITER_NAME
    names = sorted(p[len(root) + 1:] for p in mem.find(root) if p[len(root) + 1:] not in (marker, writer))
    if not mem.exists(f"{root}/{marker}"):
        raise RuntimeError(f"{staged!r} holds no committed checkpoint (no {marker})")
    names.append(marker)

    def body(name: str) -> memoryview:
        f = mem.store[f"{root}/{name}"]
        try:
            return f.getbuffer()
        except AttributeError:  # pragma: no cover - another fsspec memory file type
            return memoryview(mem.cat_file(f"{root}/{name}"))

    views = {name: body(name) for name in names}
    metadata = json.loads(bytes(views[marker]))
    storages = torch_pickle.storages if torch_pickle is not None else {}
    ranges, virtual = _torchzip.map_data_files(
        metadata, {n: v.nbytes for n, v in views.items()}, storages,
        lambda file, gaps: all(bytes(views[file][a:b]).count(0) == b - a for a, b in gaps))
    z = _torchzip.FOLDER
    records: list[tuple[str, list]] = [(_torchzip.PACK_RECORD, [_torchzip.PACK_MAGIC])]
    if torch_pickle is not None:
        records += [(f"{z}/data.pkl", [torch_pickle.data_pkl]), (f"{z}/.format_version", [b"1"]),
                    (f"{z}/.storage_alignment", [str(_torchzip.ALIGN).encode()]), (f"{z}/byteorder", [b"little"])]
    for key, fqn in storages.items():
        if ranges[key] is not None:
            records.append((f"{z}/data/{key}", [views[f][o:o + n] for f, o, n in ranges[key]]))
        else:  # a layout that maps onto no byte ranges: a copy of the tensor's bytes
            tm = _torchzip.tensor_meta(metadata, fqn)
            if tm is None:
                raise RuntimeError(f"{staged!r}: the checkpoint holds no tensor {fqn!r} that data.pkl names")
            records.append((f"{z}/data/{key}", [_torchzip.assemble(tm, lambda f, o, n: views[f][o:o + n])]))
    records += [(_torchzip.MEMBERS + name, [views[name]]) for name in names if name not in virtual]
    records.append((f"{z}/version", [b"3\n"]))

    def index(placed: dict[str, _torchzip.Placed]) -> bytes:
        doc: dict[str, Any] = {"format": "unickpt-lightning-pack", "format_version": 2, **(extra or {})}
        members = {n: placed[_torchzip.MEMBERS + n] for n in names if n not in virtual}
        doc["files"] = {n: [p.offset, p.size, p.crc] for n, p in members.items()}
        doc["virtual"] = {f: {"size": seg.size, "segments": [[fo, n, placed[f"{z}/data/{key}"].offset + ro]
                                                              for fo, n, key, ro in seg.parts]}
                          for f, seg in virtual.items()}
        return _torchzip.index_json(doc)

    chunks, _ = _torchzip.write_zip(records, (_torchzip.INDEX_RECORD, index))
    _write_atomic(path, chunks, options)
    return sum(memoryview(c).nbytes for c in chunks)


def write_placeholder(path: str, options: dict | None, token: str) -> None:
    """Make ``path`` exist (a small JSON file) while its first save is in flight."""
    doc = {"format": PENDING_FORMAT, "host": socket.gethostname(), "pid": os.getpid(), "token": token,
           "note": "unickpt: the checkpoint saved here has not committed yet"}
    _write_atomic(path, [json.dumps(doc).encode()], options)


def read_placeholder(path: str, options: dict | None) -> dict | None:
    """The placeholder document at ``path``, or None if ``path`` is no placeholder (any more)."""
    try:
        if _local(path):
            with open(_strip_file(path), "rb") as f:
                head = f.read(_MAX_PLACEHOLDER + 1)
        else:
            fs, _ = fsspec.core.url_to_fs(path, **(options or {}))
            with fs.open(path, "rb") as f:
                head = f.read(_MAX_PLACEHOLDER + 1)
        doc = json.loads(head)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == PENDING_FORMAT else None


def placeholder_alive(doc: dict) -> bool:
    """Whether the process that wrote placeholder ``doc`` may still commit (same host: it runs;
    another host: unknown, so True)."""
    if doc.get("host") != socket.gethostname():
        return True
    pid = doc.get("pid")
    return isinstance(pid, int) and ext.CheckpointDir.pid_alive(pid)


def remove_path(path: str, options: dict | None) -> None:
    """Remove ``path`` itself (a file, a symlink, not its target; a directory tree), if present."""
    if _local(path):
        p = _strip_file(path)
        if os.path.islink(p) or os.path.isfile(p):
            os.remove(p)
        elif os.path.isdir(p):
            import shutil

            shutil.rmtree(p)
        return
    fs, _ = fsspec.core.url_to_fs(path, **(options or {}))
    if fs.exists(path):
        fs.rm(path, recursive=True)


# -- reading: a read-only fsspec file system over one open pack -----------------------------------
class _Pack:
    """One open pack file: its index and positional reads through one handle."""

    def __init__(self, path: str, options: dict | None):
        self.path = path
        self._lock = threading.Lock()
        if _local(path):
            self._fd: int | None = os.open(_strip_file(path), os.O_RDONLY)
            self._f = None
            size = os.fstat(self._fd).st_size
        else:
            fs, _ = fsspec.core.url_to_fs(path, **(options or {}))
            self._fd = None
            self._f = fs.open(path, "rb")
            size = self._f.size
        self.virtual: dict[str, dict] = {}
        self._starts: dict[str, list[int]] = {}
        self._checked: set[str] = set()
        self._verified: dict[str, bytes] = {}  # small members, as checked (read once)
        try:
            damaged = f"{path!r}: damaged unickpt checkpoint file (truncated or not a pack; {size} bytes)"
            head = self.pread(0, 64)
            if _torchzip.is_pack_head(head):  # format 2: a torch.save zip archive
                where = _torchzip.read_tail(self.pread(max(0, size - _torchzip.TAIL_BYTES), _torchzip.TAIL_BYTES))
                if where is None or where[0] + where[1] > size:
                    raise ValueError(damaged)
                off, length, crc = where
                if zlib.crc32(self.pread(off, length)) != crc:
                    raise ValueError(f"{path!r}: damaged unickpt checkpoint file (its index fails its CRC-32)")
            else:  # format 1: MAGIC | members | index | footer
                tail = self.pread(max(0, size - _FOOTER.size - len(MAGIC)), _FOOTER.size + len(MAGIC))
                if size < 2 * len(MAGIC) + _FOOTER.size or tail[_FOOTER.size:] != MAGIC or \
                        not head.startswith(MAGIC):
                    raise ValueError(damaged)
                off, length = _FOOTER.unpack(tail[:_FOOTER.size])
            try:
                self.index = json.loads(self.pread(off, length))
                self.files: dict[str, list[int]] = self.index["files"]
                self.virtual = self.index.get("virtual", {})
                self.sizes = {**{n: int(v[1]) for n, v in self.files.items()},
                              **{n: int(v["size"]) for n, v in self.virtual.items()}}
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path!r}: damaged unickpt checkpoint file (unreadable index)") from None
        except BaseException:
            self.close()
            raise

    def _check(self, member: str) -> None:
        """Check a member record's CRC-32 (format 2; once per open pack): unickpt's checksums cover the
        tensor bytes, this the metadata and objects. A member of at most :data:`_KEEP_VERIFIED` bytes
        (the metadata, object files) is kept as read, so its bytes are read once. Raises IntegrityError
        naming the file and member."""
        entry = self.files[member]
        if len(entry) < 3 or member in self._checked:
            return
        off, size, crc = entry[:3]
        keep = size <= _KEEP_VERIFIED
        value, pos, parts = 0, 0, []
        while pos < size:
            n = min(8 << 20, size - pos)
            part = self.pread(off + pos, n)  # fewer bytes at a cut file's end: the CRC-32 fails below
            value = zlib.crc32(part, value)
            parts += [part] if keep else []
            pos += n
        if value != crc:
            raise IntegrityError(f"{self.path!r}: damaged unickpt checkpoint file: its member {member!r} fails its "
                                 f"CRC-32 (recorded {crc:08x}, read {value:08x})")
        if keep:
            self._verified[member] = b"".join(parts)
        self._checked.add(member)

    def read(self, member: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``member`` (a record, or a data file made of parts of the tensor
        records: zeros between its parts)."""
        if member in self.files:
            self._check(member)
            kept = self._verified.get(member)
            if kept is not None:
                return kept[start:end]
            return self.pread(self.files[member][0] + start, max(0, end - start))
        segments = self.virtual[member]["segments"]  # sorted by file offset, not overlapping
        starts = self._starts.get(member)
        if starts is None:
            starts = self._starts[member] = [seg[0] for seg in segments]
        out = bytearray(max(0, end - start))
        for file_off, n, pack_off in segments[max(0, bisect.bisect_right(starts, start) - 1):]:
            if file_off >= end:
                break
            a, b = max(start, file_off), min(end, file_off + n)
            if a < b:
                out[a - start:b - start] = self.pread(pack_off + (a - file_off), b - a)
        return bytes(out)

    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of the pack file (fewer at its end)."""
        if self._fd is not None:
            out = bytearray()
            while len(out) < length:
                chunk = os.pread(self._fd, length - len(out), offset + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)
        with self._lock:
            if self._f is None:
                raise ValueError(f"{self.path!r}: the pack file is closed")
            self._f.seek(offset)
            return self._f.read(length)

    def close(self) -> None:
        """Close the file handle."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._f is not None:
            self._f.close()
            self._f = None


_OPEN: dict[str, _Pack] = {}
_OPEN_LOCK = threading.Lock()


class PackFileSystem(AbstractFileSystem):
    """``unickptpack://<token>/<member>``: the members of an open pack (see :func:`open_pack`)."""

    protocol = PROTOCOL
    cachable = False
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = os.fspath(path) if not isinstance(path, str) else path
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/")

    def _split(self, path: str) -> tuple[_Pack, str]:
        token, _, member = self._strip_protocol(path).partition("/")
        with _OPEN_LOCK:
            pack = _OPEN.get(token)
        if pack is None:
            raise FileNotFoundError(path)
        return pack, member

    def info(self, path: str, **kwargs: Any) -> dict:
        """fsspec ``info`` of a member (a file) or of a folder of members."""
        pack, member = self._split(path)
        if member in pack.sizes:
            return {"name": self._strip_protocol(path), "size": pack.sizes[member], "type": "file"}
        if member == "" or any(n.startswith(member + "/") for n in pack.sizes):
            return {"name": self._strip_protocol(path), "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        """The members (and member folders) directly under ``path``."""
        pack, member = self._split(path)
        base = self._strip_protocol(path)
        prefix = member + "/" if member else ""
        names = sorted({n[len(prefix):].split("/", 1)[0] for n in pack.sizes if n.startswith(prefix)})
        if not names and member not in pack.sizes:
            raise FileNotFoundError(path)
        out = [self.info(f"{base}/{n}") for n in names]
        return out if detail else [o["name"] for o in out]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        """Bytes ``[start, end)`` of a member (negative values count from its end, as fsspec's)."""
        pack, member = self._split(path)
        if member not in pack.sizes:
            raise FileNotFoundError(path)
        size = pack.sizes[member]
        start = 0 if start is None else (start if start >= 0 else size + start)
        end = size if end is None else (min(end, size) if end >= 0 else size + end)
        return pack.read(member, start, end)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        import io

        if "r" not in mode:
            raise PermissionError(f"{path}: unickpt packs are read-only")
        return io.BytesIO(self.cat_file(path))


fsspec.register_implementation(PROTOCOL, PackFileSystem, clobber=True)


@contextmanager
def open_pack(path: str, options: dict | None = None) -> Iterator[tuple[str, dict]]:
    """Open the pack at ``path``; yield ``(url, index)``: ``url`` is the unickpt checkpoint inside
    (``unickptpack://<token>``, for :func:`unickpt.load` / ``Storage``), read through one handle."""
    pack = _Pack(path, options)
    token = uuid.uuid4().hex
    with _OPEN_LOCK:
        _OPEN[token] = pack
    try:
        yield f"{PROTOCOL}://{token}", pack.index
    finally:
        with _OPEN_LOCK:
            _OPEN.pop(token, None)
        pack.close()


def wait_placeholder(path: str, options: dict | None, timeout_s: float) -> None:
    """Wait while ``path`` is a placeholder of a live writer in another process (up to
    ``timeout_s``). Raises ``unickpt.CheckpointNotFoundError`` if its writer is gone or the wait
    times out."""
    from unickpt import CheckpointNotFoundError

    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        doc = read_placeholder(path, options)
        if doc is None:
            return
        if not placeholder_alive(doc):
            raise CheckpointNotFoundError(
                f"{path!r}: its save never committed (the writing process {doc.get('pid')} on {doc.get('host')} "
                "is gone); nothing was saved there")
        if time.monotonic() > deadline:
            raise CheckpointNotFoundError(f"{path!r}: a save by process {doc.get('pid')} on {doc.get('host')} "
                                          f"has not committed after {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)

