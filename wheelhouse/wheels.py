"""Wheel files: name parsing, METADATA extraction, and relabelling into a variant's local version.

Names, versions and tags go through ``packaging``; nothing here re-implements them.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, parse_tag
from packaging.utils import (
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from wheelhouse.errors import InvalidWheel, VersionMismatch

MAX_FILENAME_LENGTH = 255
MAX_METADATA_BYTES = 1024 * 1024
"""The largest METADATA a wheel may hold (PEP 658 serves it, and every server process keeps
it in memory): real ones are a few KiB, the longest READMEs a few hundred. At most this plus
one byte is ever inflated, so a member that inflates to gigabytes is refused unread."""
_CHUNK = 1024 * 1024
# What a wheel name can hold: PEP 427 escaped names, PEP 440 versions, and tags. packaging's
# parser accepts any Unicode word character in names and anything at all in tags.
_FILENAME = re.compile(r"[A-Za-z0-9._+!-]+")


@dataclass(frozen=True)
class WheelName:
    """A parsed wheel file name."""

    filename: str
    project: NormalizedName
    version: Version
    tags: frozenset[Tag]

    @property
    def dist_name(self) -> str:
        """The name as it appears in file and ``.dist-info`` names (underscores)."""
        return self.project.replace("-", "_")


def parse_name(filename: str) -> WheelName:
    """Parse a wheel file name, rejecting anything that is not a plain, valid wheel name."""
    if (
        len(filename) > MAX_FILENAME_LENGTH
        or "/" in filename
        or "\\" in filename
        or filename.startswith(".")
        or not _FILENAME.fullmatch(filename)
    ):
        raise InvalidWheel(f"{filename[:80]!r} is not a wheel file name")
    try:
        name, version, _build, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename as exc:
        raise InvalidWheel(f"{filename[:80]!r} is not a valid wheel file name: {exc}") from None
    if not all(t.interpreter and t.abi and t.platform for t in tags):
        raise InvalidWheel(f"{filename[:80]!r} has an empty tag")
    return WheelName(filename, name, version, tags)


#: A wheel variant label (PEP 825): the extra part before ``.whl``.
VARIANT_LABEL = re.compile(r"[0-9a-z_.]{1,16}")


def split_variant_label(filename: str) -> tuple[str, str | None]:
    """``x-1.0-py3-none-any-cu130sm90.whl`` → (``x-1.0-py3-none-any.whl``, ``cu130sm90``).

    A plain wheel name comes back as it is, with None. Six parts are a build tag when the third
    starts with a digit (the wheel spec's rule), else a variant label; seven are both.
    """
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (6, 7):
        return filename, None
    if len(parts) == 6 and parts[2][:1].isdigit():
        return filename, None
    label = parts[-1]
    if not VARIANT_LABEL.fullmatch(label):
        return filename, None
    return "-".join(parts[:-1]) + ".whl", label


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _dist_info_dir(zf: zipfile.ZipFile) -> str:
    dirs = {top for n in zf.namelist() if (top := n.split("/", 1)[0]).endswith(".dist-info")}
    if len(dirs) != 1:
        raise InvalidWheel(f"wheel must hold exactly one .dist-info directory, found {len(dirs)}")
    return dirs.pop()


def read_metadata(path: Path) -> bytes:
    """The wheel's ``.dist-info/METADATA``, byte for byte (what PEP 658 serves), at most
    :data:`MAX_METADATA_BYTES`."""
    try:
        with zipfile.ZipFile(path) as zf:
            info_dir = _dist_info_dir(zf)
            try:
                return _read_metadata_member(zf, info_dir)
            except InvalidWheel as exc:
                raise InvalidWheel(f"{path.name}: {exc}") from None
    except (zipfile.BadZipFile, zlib.error, KeyError, EOFError) as exc:
        raise InvalidWheel(f"{path.name}: not a readable wheel ({exc})") from None


def _read_metadata_member(zf: zipfile.ZipFile, info_dir: str) -> bytes:
    return _read_capped(zf, f"{info_dir}/METADATA", MAX_METADATA_BYTES)


def _read_capped(zf: zipfile.ZipFile, member: str, cap: int) -> bytes:
    """A member read into memory, refused past ``cap`` bytes whatever its header claims: the
    declared size is checked first, and the read stops one byte past the cap."""
    info = zf.getinfo(member)
    too_big = InvalidWheel(f"{member.rpartition('/')[2]} is larger than {cap // 1024} KiB")
    if info.file_size > cap:
        raise too_big
    with zf.open(info) as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise too_big
    return data


@dataclass(frozen=True)
class CoreMetadata:
    name: str
    version: Version
    requires_python: str | None


def parse_metadata(data: bytes) -> CoreMetadata:
    msg = BytesParser().parsebytes(data, headersonly=True)
    if not msg["Name"]:
        raise InvalidWheel("METADATA is malformed: it has no Name")
    raw = msg["Requires-Python"]
    requires_python = None if raw is None else str(raw)
    if requires_python is not None:
        # Pages serve it as data-requires-python, which installers parse for every file of
        # the project: one that does not parse must not get that far.
        try:
            SpecifierSet(requires_python)
        except InvalidSpecifier:
            raise InvalidWheel(f"METADATA is malformed: Requires-Python "
                               f"{requires_python[:80]!r} is no version specifier") from None
    try:
        return CoreMetadata(
            name=str(msg["Name"]),
            version=Version(str(msg["Version"])),
            requires_python=requires_python,
        )
    except InvalidVersion as exc:  # a missing Version header reads as "None"
        raise InvalidWheel(f"METADATA is malformed: {exc}") from None


def check_consistent(path: Path, name: WheelName) -> CoreMetadata:
    """Refuse a wheel whose METADATA name or version differs from its file name.

    pip rejects such wheels ("inconsistent version"), which is exactly the defect of the
    upstream flash-attn release wheels that get their label added by ``sed`` after the build.
    """
    return consistent_metadata(read_metadata(path), name)


def consistent_metadata(metadata: bytes, name: WheelName) -> CoreMetadata:
    """:func:`check_consistent` for METADATA already read (by a check that ran elsewhere)."""
    meta = parse_metadata(metadata)
    if canonicalize_name(meta.name) != name.project:
        raise InvalidWheel(
            f"{name.filename}: METADATA names project {meta.name!r}, the file name {name.project!r}"
        )
    if meta.version != name.version:
        raise VersionMismatch(
            f"{name.filename}: METADATA says version {meta.version}, the file name says "
            f"{name.version}; pip refuses such a wheel. Publish with --relabel to rewrite it."
        )
    return meta


def with_local_label(version: Version, label: str) -> Version:
    return Version(f"{version.public}+{label}")


def relabel(path: Path, label: str, dest_dir: Path) -> Path:
    """Rewrite a wheel into ``version.public+label``: file name, .dist-info, METADATA and RECORD.

    The new wheel is written into ``dest_dir``; the source is left untouched.
    """
    name = parse_name(path.name)
    meta = parse_metadata(read_metadata(path))
    if meta.version.public != name.version.public:
        raise VersionMismatch(
            f"{name.filename}: METADATA says {meta.version}, the file name {name.version}; "
            "their public versions differ, so no label can reconcile them"
        )
    new_version = with_local_label(name.version, label)
    old_prefix = path.name.split("-", 2)[:2]
    new_filename = "-".join([old_prefix[0], str(new_version)]) + path.name[
        len("-".join(old_prefix)):
    ]
    parse_name(new_filename)
    return _rewrite(
        path, dest_dir / new_filename,
        new_info=f"{old_prefix[0]}-{new_version}.dist-info",
        edit_metadata=lambda data: edit_metadata(data, version=new_version),
    )


def rewrite_wheel(path: Path, dest: Path, version: Version, *,
                  more: Callable[[bytes], bytes] | None = None,
                  add_info: Mapping[str, bytes] | None = None) -> Path:
    """Copy a wheel to ``dest`` (whose file name the caller chose) as ``version``: .dist-info,
    .data and METADATA follow, ``more`` edits METADATA further, ``add_info`` adds
    files to the .dist-info, and RECORD matches. The same input gives the same bytes."""
    dist = path.name.split("-", 1)[0]

    def edit(data: bytes) -> bytes:
        data = edit_metadata(data, version=version)
        return more(data) if more is not None else data

    return _rewrite(path, dest, new_info=f"{dist}-{version}.dist-info", edit_metadata=edit,
                    add_info=add_info)


def add_description_note(path: Path, note: str, dest_dir: Path) -> Path:
    """Write a copy of the wheel into ``dest_dir`` whose METADATA description ends with ``note``.

    The description is the METADATA body (core metadata 2.1+); installers ignore it, so the
    wheel installs exactly as before. File name and version are unchanged; RECORD is rewritten.
    """
    parse_name(path.name)
    return _rewrite(path, dest_dir / path.name, new_info=None,
                    edit_metadata=lambda data: edit_metadata(data, note=note))


def pin_torch(path: Path, requirement: str, dest_dir: Path) -> Path:
    """The wheel (a copy in ``dest_dir`` where METADATA changes) requiring ``requirement``
    (``torch==2.14.*``) in its headers: a wheel built against one torch must not install beside
    another (its undefined symbols are the error prebuilt-wheel users report most). File name
    and version are unchanged; RECORD is rewritten."""
    metadata = read_metadata(path)
    if edit_metadata(metadata, torch=requirement) == metadata:
        return path
    parse_name(path.name)
    return _rewrite(path, dest_dir / path.name, new_info=None,
                    edit_metadata=lambda data: edit_metadata(data, torch=requirement))


def _rewrite(
    path: Path, dest: Path, *, new_info: str | None, edit_metadata: Callable[[bytes], bytes],
    add_info: Mapping[str, bytes] | None = None,
) -> Path:
    """Copy a wheel to ``dest``, renaming its .dist-info (and .data) to ``new_info`` if given and
    passing METADATA through ``edit_metadata``, with a RECORD that matches the new contents.
    ``add_info`` are files to write into the .dist-info (replacing any of the same name)."""
    with zipfile.ZipFile(path) as src:
        old_info = _dist_info_dir(src)
        new_info = new_info or old_info
        # The .data directory carries the version too; installers (uv) only honour the one
        # that matches .dist-info and would copy a stale one into site-packages verbatim.
        old_data = old_info.removesuffix(".dist-info") + ".data"
        new_data = new_info.removesuffix(".dist-info") + ".data"
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, suffix=".whl.part")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            records: list[tuple[str, str, str]] = []
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as out:
                for info in src.infolist():
                    arcname = info.filename
                    top, _, rest = arcname.partition("/")
                    if top == old_info:
                        if rest == "RECORD" or rest in (add_info or {}):
                            continue
                        arcname = f"{new_info}/{rest}"
                    elif top == old_data:
                        arcname = f"{new_data}/{rest}"
                    data = src.read(info)
                    if arcname == f"{new_info}/METADATA":
                        data = edit_metadata(data)
                    zi = zipfile.ZipInfo(arcname, date_time=info.date_time)
                    zi.external_attr = info.external_attr
                    zi.compress_type = zipfile.ZIP_DEFLATED
                    out.writestr(zi, data)
                    if not arcname.endswith("/"):
                        records.append(_record_row(arcname, data))
                newest = max(i.date_time for i in src.infolist())
                for rest, data in (add_info or {}).items():
                    zi = zipfile.ZipInfo(f"{new_info}/{rest}", date_time=newest)
                    zi.external_attr = 0o644 << 16
                    zi.compress_type = zipfile.ZIP_DEFLATED
                    out.writestr(zi, data)
                    records.append(_record_row(zi.filename, data))
                buf = io.StringIO()
                writer = csv.writer(buf, lineterminator="\n")
                writer.writerows(records)
                writer.writerow((f"{new_info}/RECORD", "", ""))
                # Dated like the rest of the wheel, not "now": relabelling the same wheel
                # twice must give the same bytes, or republishing it is refused as different.
                record_info = zipfile.ZipInfo(f"{new_info}/RECORD", date_time=newest)
                record_info.external_attr = 0o644 << 16
                record_info.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(record_info, buf.getvalue())
            shutil.move(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _record_row(arcname: str, data: bytes) -> tuple[str, str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return arcname, "sha256=" + digest, str(len(data))


def _split_metadata(metadata: bytes) -> tuple[list[bytes], bytes, bytes]:
    """Core metadata as its header lines, its body (the description, verbatim) and its line
    ending. The headers end at the first empty line (RFC 822, as ``email`` and
    ``packaging.metadata`` read it) or at the end, where there is no body."""
    eol = b"\r\n" if metadata.split(b"\n", 1)[0].endswith(b"\r") else b"\n"
    lines = metadata.split(eol)
    for i, line in enumerate(lines):
        if not line.strip(b"\r"):
            return lines[:i], eol.join(lines[i + 1:]), eol
    return lines, b"", eol


_TORCH_REQUIREMENT = re.compile(rb"Requires-Dist:\s*torch(?![A-Za-z0-9._-])[^;]*$", re.I)


def edit_metadata(metadata: bytes, *, version: Version | None = None,
                  torch: str | None = None, note: str | None = None) -> bytes:
    """The one rewrite of core metadata: ``version`` replaces the Version header, ``torch``
    (``torch==2.14.*``) replaces every torch requirement without a marker (a marker'd one, an
    extra's, is left alone) and is added where there is none, ``note`` becomes the last
    paragraph of the description. Headers stay headers: whatever the input's shape (no body,
    no final newline, CRLF), the result's header block ends with one empty line before the
    body, so installers read a ``Requires-Dist`` added here (issue 30)."""
    headers, body, eol = _split_metadata(metadata)
    if version is not None:
        at = next((i for i, line in enumerate(headers) if line.startswith(b"Version:")), None)
        if at is None:
            raise InvalidWheel("METADATA has no Version header")
        headers[at] = b"Version: " + str(version).encode()
    if torch is not None:
        headers = [line for line in headers if not _TORCH_REQUIREMENT.match(line)]
        headers.append(b"Requires-Dist: " + torch.encode())
    if note is not None:
        if not note.strip():
            raise ValueError("empty note")
        text = note.strip("\n").replace("\n", eol.decode()).encode("utf-8")
        kept = body.rstrip(b"\r\n")
        body = (kept + eol + eol if kept else b"") + text + eol
    return eol.join(headers) + eol + eol + body


#: RECORD hash algorithms a wheel may use: sha256 or stronger (PEP 376, the wheel spec).
RECORD_HASHES = frozenset({"sha256", "sha384", "sha512"})
MAX_UNPACKED_BYTES = 32 * 1024**3
"""The most a wheel may unpack to before validation refuses to read it through."""
_SIGNATURES = ("RECORD.jws", "RECORD.p7s")
# What validation reads whole into memory, besides METADATA: WHEEL is a few headers; RECORD a
# line per file (torch's, some 20,000 files, is under 3 MiB).
_MAX_WHEEL_FILE = 64 * 1024
_MAX_RECORD = 64 * 1024 * 1024


def validate_wheel(
    path: Path, expected_name: str, expected_version: Version,
    accepts_tags: Callable[[frozenset[Tag]], bool], *,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES, relabelling: bool = False,
) -> WheelName:
    """Check a built wheel before it is published; raise :class:`InvalidWheel` with one line.

    What a build leaves behind is untrusted: the file must be a regular file and a well-formed
    zip whose member names stay inside the install tree (no absolute paths, ``..``,
    backslashes, links or devices, no name twice); RECORD must list every member with a
    matching hash and size; METADATA's name and version and WHEEL's tags must agree with the
    file name; and the file name must be the expected project and version with tags that
    ``accepts_tags`` (e.g. ``BuildSpec.tags_match``) accepts. With ``relabelling`` (the wheel
    is about to go through :func:`relabel`, which rewrites them) METADATA and the
    ``.dist-info`` need only carry the file name's public version.
    """
    name = parse_name(path.name)
    where = name.filename
    if name.project != canonicalize_name(expected_name):
        raise InvalidWheel(f"{where}: built project {name.project}, expected "
                           f"{canonicalize_name(expected_name)}")
    if name.version != expected_version:
        raise InvalidWheel(f"{where}: built version {name.version}, expected {expected_version}")
    if not accepts_tags(name.tags):
        tags = ", ".join(sorted(str(t) for t in name.tags))
        raise InvalidWheel(f"{where}: tags {tags} are not the ones this build must produce")
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise InvalidWheel(f"{where}: not a regular file")
    try:
        with zipfile.ZipFile(path) as zf:
            _validate_contents(zf, name, max_unpacked_bytes, relabelling)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # a corrupt deflate stream
        raise InvalidWheel(f"{where}: not a well-formed zip ({' '.join(str(exc).split())})"
                           ) from None
    return name


def _validate_contents(zf: zipfile.ZipFile, name: WheelName, max_unpacked: int,
                       relabelling: bool) -> None:
    where = name.filename

    def same(version: Version | None) -> bool:
        if relabelling:
            return version is not None and version.public == name.version.public
        return version == name.version

    infos = zf.infolist()
    seen: set[str] = set()
    for info in infos:
        _check_member_name(where, info.filename)
        if info.filename in seen:
            raise InvalidWheel(f"{where}: member {info.filename[:120]!r} appears twice")
        seen.add(info.filename)
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            what = "a symbolic link" if kind == stat.S_IFLNK else "a special file"
            raise InvalidWheel(f"{where}: member {info.filename[:120]!r} is {what}")
    unpacked = sum(info.file_size for info in infos)
    if unpacked > max_unpacked:
        raise InvalidWheel(f"{where}: unpacks to {unpacked / 1024**2:,.0f} MiB, over the "
                           f"{max_unpacked / 1024**2:,.0f} MiB allowed")
    try:
        info_dir = _dist_info_dir(zf)
    except InvalidWheel as exc:
        raise InvalidWheel(f"{where}: {exc}") from None
    dist, _, version = info_dir.removesuffix(".dist-info").partition("-")
    try:
        dir_version = Version(version)
    except InvalidVersion:
        dir_version = None
    if canonicalize_name(dist) != name.project or not same(dir_version):
        raise InvalidWheel(f"{where}: its .dist-info directory {info_dir[:120]!r} names "
                           "another project or version")
    try:
        meta = parse_metadata(_read_metadata_member(zf, info_dir))
        wheel = BytesParser().parsebytes(_read_capped(zf, f"{info_dir}/WHEEL", _MAX_WHEEL_FILE),
                                         headersonly=True)
        record = _read_capped(zf, f"{info_dir}/RECORD", _MAX_RECORD).decode("utf-8")
    except KeyError as exc:
        raise InvalidWheel(f"{where}: {exc.args[0]}") from None
    except InvalidWheel as exc:  # a member too large, METADATA malformed: one line, named
        raise InvalidWheel(f"{where}: {exc}") from None
    except UnicodeDecodeError:
        raise InvalidWheel(f"{where}: RECORD is not UTF-8") from None
    if canonicalize_name(meta.name) != name.project:
        raise InvalidWheel(f"{where}: METADATA names project {meta.name[:80]!r}")
    if not same(meta.version):
        raise VersionMismatch(f"{where}: METADATA says version {meta.version}, the file name "
                              f"{name.version}")
    if not str(wheel.get("Wheel-Version", "")).startswith("1."):
        raise InvalidWheel(f"{where}: WHEEL has no Wheel-Version 1.x")
    try:
        wheel_tags = {t for value in wheel.get_all("Tag", []) for t in parse_tag(str(value))}
    except ValueError:
        raise InvalidWheel(f"{where}: WHEEL has a malformed Tag") from None
    if wheel_tags != set(name.tags):
        tags = ", ".join(sorted(str(t) for t in wheel_tags)) or "none"
        raise InvalidWheel(f"{where}: WHEEL says tags {tags}, the file name does not")
    _check_installed_dist_info(where, infos)
    _check_record(zf, where, info_dir, record)


def _check_installed_dist_info(where: str, infos: list[zipfile.ZipInfo]) -> None:
    """Refuse a ``.dist-info`` that installing would put into site-packages beside the wheel's
    own (under ``<name>.data/purelib/`` or ``platlib/``): it would pose as another project,
    installed, to every installer and ``importlib.metadata``."""
    for info in infos:
        parts = info.filename.split("/")
        if len(parts) > 2 and parts[0].endswith(".data") and parts[2].endswith(".dist-info"):
            raise InvalidWheel(f"{where}: {info.filename[:120]!r} would install the "
                               ".dist-info of another project")


def _check_member_name(where: str, member: str) -> None:
    parts = member.split("/")
    if (not member or member.startswith("/") or "\\" in member or "\0" in member
            or ".." in parts or ":" in parts[0]):
        raise InvalidWheel(f"{where}: member name {member[:120]!r} escapes the install tree")


def _check_record(zf: zipfile.ZipFile, where: str, info_dir: str, record: str) -> None:
    listed: dict[str, tuple[str, str]] = {}
    try:
        rows = list(csv.reader(io.StringIO(record)))
    except csv.Error:
        raise InvalidWheel(f"{where}: RECORD is not CSV") from None
    for row in rows:
        if not row:
            continue
        if len(row) != 3:
            raise InvalidWheel(f"{where}: RECORD has a row of {len(row)} fields")
        member, digest, size = row
        _check_member_name(where, member)
        if member in listed:
            raise InvalidWheel(f"{where}: RECORD lists {member[:120]!r} twice")
        listed[member] = (digest, size)
    unsigned = {f"{info_dir}/RECORD", *(f"{info_dir}/{sig}" for sig in _SIGNATURES)}
    members = {info.filename: info for info in zf.infolist() if not info.is_dir()}
    for member in listed:
        if member not in members:
            raise InvalidWheel(f"{where}: RECORD lists {member[:120]!r}, which is not in the wheel")
    for member, info in members.items():
        if member in unsigned:
            continue
        if member not in listed:
            raise InvalidWheel(f"{where}: {member[:120]!r} is not in RECORD")
        digest, size = listed[member]
        algorithm, _, expected = digest.partition("=")
        if algorithm not in RECORD_HASHES:
            raise InvalidWheel(f"{where}: RECORD hashes {member[:120]!r} with "
                               f"{algorithm[:20] or 'nothing'}, not sha256 or stronger")
        h = hashlib.new(algorithm)
        length = 0
        with zf.open(info) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                length += len(chunk)
        actual = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
        if actual != expected or str(length) != size:
            raise InvalidWheel(f"{where}: {member[:120]!r} does not match its RECORD hash "
                               "and size")
