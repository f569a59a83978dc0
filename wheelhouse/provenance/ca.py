"""The fleet's certificate authority: one self-signed ECDSA P-256 root, and the short-lived
certificates it issues directly to workers and the index (no intermediates).

The CA's key stays with the operator (``wheelhouse ca init DIR``, offline); each signer gets a
certificate and key from ``wheelhouse ca issue NAME`` and is configured with
``WHEELHOUSE_PROVENANCE_CERT`` / ``_KEY``, verifiers with ``WHEELHOUSE_PROVENANCE_CA``. Where
those are unset (one box: ``wheelhouse build``, ``serve``), :func:`signer_for` makes a CA and a
certificate in the workspace on first use, as the private Redis is, so provenance needs no set-up.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from wheelhouse.config import Config
from wheelhouse.errors import ProvenanceInvalid, ProvenanceUnavailable

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
#: Where, below the workspace, a box without a configured CA keeps its own.
WORKSPACE_DIR = "provenance"
CA_DAYS = 3650
LEAF_DAYS = 30.0
#: A workspace certificate this close to expiry is replaced before it signs.
_RENEW_BEFORE = timedelta(days=1)


@dataclass(frozen=True)
class Identity:
    """A certificate and its private key: the CA's, or a signer's."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def name(self) -> str:
        return common_name(self.cert)


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else ""
    return value if isinstance(value, str) else value.decode(errors="replace")


def _write_private(path: Path, data: bytes) -> None:
    """A key file readable by its owner only, from its first byte (never chmod-ed after)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "wheelhouse")])


def init_ca(directory: Path, name: str = "wheelhouse fleet CA") -> Identity:
    """Make the CA (key 0600, self-signed certificate) in ``directory``; refuses to replace one,
    since every certificate it issued would stop verifying."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_KEY).exists() or (directory / CA_CERT).exists():
        raise FileExistsError(f"{directory} already holds a CA ({CA_CERT}, {CA_KEY}); "
                              "a new one would orphan every certificate it issued")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    subject = _name(name)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(directory / CA_KEY, _key_pem(key))
    (directory / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Identity(cert, key)


def load_ca(directory: Path) -> Identity:
    return load_identity(directory / CA_CERT, directory / CA_KEY)


def load_identity(cert_path: Path, key_path: Path) -> Identity:
    """A certificate and its key, which must belong together: a signature by another key (a
    renewal read half-way, a file swapped) would not verify."""
    for attempt in range(3):
        cert = load_cert(cert_path)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ProvenanceInvalid(f"{key_path}: not an ECDSA private key")
        if key.public_key() == cert.public_key():
            return Identity(cert, key)
        time.sleep(0.1 * (attempt + 1))  # a renewal replaces the key, then the certificate
    raise ProvenanceInvalid(f"{key_path} is not the key of {cert_path}")


def load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise ProvenanceInvalid(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ProvenanceInvalid(f"{path}: not a PEM certificate ({exc})") from None


def issue(ca: Identity, name: str, *, days: float = LEAF_DAYS) -> Identity:
    """A certificate and key for the signer ``name``, issued directly by ``ca``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(min(now + timedelta(days=days), ca.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return Identity(cert, key)


def identity_paths(directory: Path, name: str) -> tuple[Path, Path]:
    """Where :func:`write_identity` keeps the signer ``name``: ``<name>.pem``, ``<name>.key``."""
    stem = _file_stem(name)
    return directory / f"{stem}.pem", directory / f"{stem}.key"


def write_identity(identity: Identity, directory: Path) -> tuple[Path, Path]:
    """``<name>.pem`` and ``<name>.key`` (0600) in ``directory``, each replaced whole (a
    renewal under a running signer: it reads either pair, and :func:`load_identity` waits out
    the moment between the two)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = identity_paths(directory, identity.name)
    for path, data, private in ((key_path, _key_pem(identity.key), True),
                                (cert_path, identity.cert.public_bytes(
                                    serialization.Encoding.PEM), False)):
        part = path.with_name(f".{path.name}.part")
        part.unlink(missing_ok=True)
        if private:
            _write_private(part, data)
        else:
            part.write_bytes(data)
        os.replace(part, path)
    return cert_path, key_path


def still_valid(ca: Identity, cert_path: Path, key_path: Path, *, for_at_least: timedelta
                ) -> x509.Certificate | None:
    """The certificate at ``cert_path`` if ``ca`` issued it, its key is beside it and it stays
    valid ``for_at_least`` longer; None where it must be (re)issued."""
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        mine = load_identity(cert_path, key_path)
        mine.cert.verify_directly_issued_by(ca.cert)
    except (OSError, ValueError, TypeError, ProvenanceInvalid, InvalidSignature):
        return None
    if mine.cert.not_valid_after_utc - datetime.now(UTC) <= for_at_least:
        return None
    return mine.cert


def _file_stem(name: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")
    if not stem or stem in ("ca",):
        raise ValueError(f"{name!r} can't name a certificate file")
    return stem


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    # Two processes of one box (serve --with-worker) may both make the CA on first use.
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with (directory / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def workspace_dir(config: Config) -> Path:
    return Path(config.workspace).resolve() / WORKSPACE_DIR


def local_identity(directory: Path, name: str) -> Identity:
    """The signer ``name`` of the CA in ``directory``, both made on first use (and the
    certificate renewed near its expiry)."""
    with _locked(directory):
        ca = load_ca(directory) if (directory / CA_KEY).exists() else init_ca(directory)
        cert_path, key_path = identity_paths(directory, name)
        if still_valid(ca, cert_path, key_path, for_at_least=_RENEW_BEFORE) is not None:
            return load_identity(cert_path, key_path)
        mine = issue(ca, name)
        write_identity(mine, directory)
        return mine


def signer_for(config: Config, name: str) -> Identity:
    """Who signs for this process: the configured certificate and key, or ``name`` from the
    workspace's own CA; :class:`ProvenanceUnavailable` where neither can be had."""
    try:
        if config.provenance_cert:
            if not config.provenance_key:
                raise ProvenanceUnavailable("WHEELHOUSE_PROVENANCE_CERT is set without "
                                            "WHEELHOUSE_PROVENANCE_KEY")
            return load_identity(Path(config.provenance_cert), Path(config.provenance_key))
        return local_identity(workspace_dir(config), name)
    except (OSError, ProvenanceInvalid) as exc:
        raise _unavailable(config, exc) from None


def ca_cert_for(config: Config) -> x509.Certificate:
    """The CA that provenance here chains to: the configured one, or the workspace's own
    (made on first use, so that a box's first build and its index agree)."""
    try:
        if config.provenance_ca:
            return load_cert(Path(config.provenance_ca))
        directory = workspace_dir(config)
        if not (directory / CA_CERT).exists():
            with _locked(directory):
                if not (directory / CA_KEY).exists():
                    init_ca(directory)
        return load_cert(directory / CA_CERT)
    except (OSError, ProvenanceInvalid) as exc:
        raise _unavailable(config, exc) from None


def _unavailable(config: Config, exc: Exception) -> ProvenanceUnavailable:
    where = ("the configured certificate (WHEELHOUSE_PROVENANCE_CA/_CERT/_KEY)"
             if config.provenance_ca or config.provenance_cert
             else f"the box's own CA in {workspace_dir(config)} (set WHEELHOUSE_WORKSPACE to a "
                  "writable directory, or WHEELHOUSE_PROVENANCE_CA/_CERT/_KEY)")
    return ProvenanceUnavailable(f"provenance can't be signed or checked: {where}: {exc}")
