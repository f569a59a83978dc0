"""``wheelhouse ca init|issue`` (the fleet CA) and ``wheelhouse verify-provenance``.

``verify-provenance`` is the user's side: it fetches a wheel's provenance the way any PEP 740
client would (the project page's ``provenance`` URL) and checks it against the fleet CA's
certificate (``--ca``, or the index's ``/api/provenance/ca.pem``), and the wheel's bytes
against its subject; it prints what built the wheel, or one line saying why it can't be trusted.
The wheel's GPU proof (``<file>.proof`` beside the provenance) is checked against the same CA
where the index serves one; a wheel without one is "not proven on a GPU", which is no failure.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import click
from cryptography import x509

from wheelhouse.errors import ProvenanceInvalid
from wheelhouse.index import proofs
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.wheels import parse_name, sha256_file

JSON = "application/vnd.pypi.simple.v1+json"


@click.group("ca")
def ca_group() -> None:
    """The fleet's certificate authority, which provenance is signed under."""


@ca_group.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default="wheelhouse fleet CA", show_default=True,
              help="The CA's common name.")
@click.option("--exist-ok", is_flag=True,
              help="A CA already in DIRECTORY is kept and is not an error (for set-up scripts "
                   "that run on every start).")
def ca_init(directory: Path, name: str, exist_ok: bool) -> None:
    """Make the CA's key (0600) and self-signed certificate in DIRECTORY; keep the key offline."""
    try:
        made = ca.init_ca(directory, name)
    except FileExistsError as exc:
        if not exist_ok:
            raise click.ClickException(str(exc)) from None
        try:
            kept = ca.load_ca(directory)
        except (OSError, ValueError) as err:
            raise click.ClickException(f"{directory}: {err}") from None
        click.echo(f"CA {kept.name!r} kept: {directory / ca.CA_CERT}")
        return
    click.echo(f"CA {made.name!r}: certificate {directory / ca.CA_CERT} (give it to every "
               f"index and verifier: WHEELHOUSE_PROVENANCE_CA), key {directory / ca.CA_KEY}")


@ca_group.command("issue")
@click.argument("name")
@click.option("--ca-dir", type=click.Path(file_okay=False, path_type=Path),
              required=True, help="The directory `wheelhouse ca init` made.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Where NAME.pem and NAME.key (0600) are written.")
@click.option("--days", type=click.FloatRange(min=0.01, max=3650), default=ca.LEAF_DAYS,
              show_default=True, help="How long the certificate is valid.")
@click.option("--renew-within", type=click.FloatRange(min=0, max=3650), default=None,
              metavar="DAYS",
              help="Keep a certificate this CA issued for NAME in --out that is valid for "
                   "longer than DAYS; issue a new one otherwise (run it on a schedule).")
def ca_issue(name: str, ca_dir: Path, out: Path, days: float,
             renew_within: float | None) -> None:
    """Issue a certificate and key for the signer NAME (a worker, or the index)."""
    try:
        authority = ca.load_ca(ca_dir)
        if renew_within is not None:
            if renew_within >= days:
                raise click.ClickException(f"--renew-within {renew_within:g} must be shorter "
                                           f"than --days {days:g}, or every run renews")
            cert_path, key_path = ca.identity_paths(out, name)
            kept = ca.still_valid(authority, cert_path, key_path,
                                  for_at_least=timedelta(days=renew_within))
            if kept is not None:
                click.echo(f"{name}: {cert_path} is valid until "
                           f"{kept.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; not renewed")
                return
        cert_path, key_path = ca.write_identity(ca.issue(authority, name, days=days), out)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: WHEELHOUSE_PROVENANCE_CERT={cert_path} "
               f"WHEELHOUSE_PROVENANCE_KEY={key_path} (valid {days:g} days)")


def _get(url: str, accept: str = "*/*") -> bytes:
    body = _fetch(url, accept, missing_ok=False)
    if body is None:  # only a 404 with missing_ok answers None
        raise ProvenanceInvalid(f"{url}: not found")
    return body


def _fetch(url: str, accept: str, *, missing_ok: bool) -> bytes | None:
    """The body at ``url``; None where it answers 404 and ``missing_ok``."""
    request = urllib.request.Request(url, headers={"Accept": accept})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310
            body: bytes = resp.read()
            return body
    except urllib.error.HTTPError as exc:
        if missing_ok and exc.code == 404:
            return None
        raise ProvenanceInvalid(f"{url}: {exc}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ProvenanceInvalid(f"{url}: {exc}") from None


def _provenance_url(index: str, filename: str) -> str:
    """The ``provenance`` URL the index's JSON project page gives ``filename`` (PEP 740)."""
    project = parse_name(filename).project
    page_url = urljoin(index.rstrip("/") + "/", f"{project}/")
    page = json.loads(_get(page_url, JSON))
    for entry in page.get("files", []):
        if entry.get("filename") == filename:
            url = entry.get("provenance")
            if not isinstance(url, str):
                raise ProvenanceInvalid(f"{filename}: the index serves it without provenance")
            return urljoin(page_url, url)
    raise ProvenanceInvalid(f"{filename} is not listed on {page_url}")


@click.command("verify-provenance")
@click.argument("wheel")
@click.option("--index", default=None, metavar="URL",
              help="The index root that lists the wheel (…/<variant>/simple/); with a URL to a "
                   "wheel, its provenance is looked for beside it.")
@click.option("--ca", "ca_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The fleet CA's certificate (PEM); default: the index's "
                                 "/api/provenance/ca.pem, which only proves the index vouches "
                                 "for itself.")
def verify_provenance(wheel: str, index: str | None, ca_path: Path | None) -> None:
    """Check WHEEL (a file, or a URL) against the index's provenance and the fleet CA."""
    try:
        with tempfile.TemporaryDirectory(prefix="wheelhouse-verify-") as tmp:
            lines = _verify(wheel, index, ca_path, Path(tmp))
    except ProvenanceInvalid as exc:
        raise click.ClickException(f"provenance does not verify: {exc}") from None
    for line in lines:
        click.echo(line)


def _verify(wheel: str, index: str | None, ca_path: Path | None, tmp: Path) -> list[str]:
    remote = urlsplit(wheel).scheme in ("http", "https")
    if remote:
        filename = urlsplit(wheel).path.rpartition("/")[2]
        path = tmp / filename
        path.write_bytes(_get(wheel.split("#", 1)[0]))
    else:
        path = Path(wheel)
        filename = path.name
    if index is not None:
        document_url = _provenance_url(index, filename)
    elif remote:
        document_url = wheel.split("#", 1)[0] + attest.SUFFIX
    else:
        raise ProvenanceInvalid("a wheel file needs --index URL: where its provenance is listed")
    if ca_path is not None:
        authority = ca.load_cert(ca_path)
    else:
        parts = urlsplit(document_url)
        authority = x509.load_pem_x509_certificate(
            _get(f"{parts.scheme}://{parts.netloc}/api/provenance/ca.pem"))
    sha256 = sha256_file(path)
    verified = attest.verify_document(_get(document_url), authority, filename, sha256)
    lines = [f"{filename} (sha256 {sha256}): provenance verifies against "
             f"{ca.common_name(authority)!r}"]
    for v in verified:
        lines.extend(f"  {line}" for line in predicates.summary(v.predicate_type, v.predicate,
                                                                v.signer))
    lines.append(f"  {_proof_line(document_url, authority, filename, sha256)}")
    return lines


def _proof_line(document_url: str, authority: x509.Certificate, filename: str,
                sha256: str) -> str:
    """What the wheel's GPU proof, served beside its provenance, says once it verifies."""
    raw = _fetch(document_url.removesuffix(attest.SUFFIX) + proofs.SUFFIX, "application/json",
                 missing_ok=True)
    if raw is None:
        return "not proven on a GPU"
    try:
        proof = proofs.GpuProof.from_json(raw)
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise ProvenanceInvalid(f"the GPU proof served for {filename} is no proof: "
                                f"{exc}") from None
    v = proofs.verify_proof(proof, authority)
    (line,) = predicates.summary(v.predicate_type, v.predicate, v.signer)
    if (proof.filename, proof.sha256) != (filename, sha256):
        # A variant form of /simple/ is served the proof of the wheel it was relabelled from.
        return f"GPU proof of {proof.filename} (sha256 {proof.sha256[:12]}…): {line}"
    return f"GPU proof: {line}"
