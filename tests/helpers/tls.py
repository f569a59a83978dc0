"""A throwaway certificate authority and server certificate for TLS tests."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    pass



@dataclasses.dataclass(frozen=True)
class TLSFiles:
    ca: Path
    """The private CA's certificate: what clients trust."""
    cert: Path
    key: Path


def make_tls_certs(directory: Path, hostname: str = "localhost") -> TLSFiles:
    """A private CA and a server certificate it signed for ``hostname`` and 127.0.0.1, made by
    the ``openssl`` command as an operator would (the README's Security section)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(ca=directory / "ca.crt", cert=directory / "redis.crt",
                     key=directory / "redis.key")
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command is required"

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=wheelhouse test CA", "-keyout", str(directory / "ca.key"), "-out", str(files.ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={hostname}",
        "-keyout", str(files.key), "-out", str(directory / "redis.csr"))
    ext = directory / "san.cnf"
    ext.write_text(f"subjectAltName=DNS:{hostname},IP:127.0.0.1\n")
    run("x509", "-req", "-days", "2", "-in", str(directory / "redis.csr"), "-CA", str(files.ca),
        "-CAkey", str(directory / "ca.key"), "-CAcreateserial", "-extfile", str(ext),
        "-out", str(files.cert))
    return files
