"""The fleet CA's certificate, for ``wheelhouse verify-provenance`` and any PEP 740 verifier."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from flask import Blueprint, Response

from web.services import services
from wheelhouse.provenance import ca

bp = Blueprint("provenance", __name__, url_prefix="/api/provenance")


@bp.get("/ca.pem")
def ca_pem() -> Response:
    """The certificate every served provenance document chains to (WHEELHOUSE_PROVENANCE_CA)."""
    cert = ca.ca_cert_for(services().config)
    return Response(cert.public_bytes(serialization.Encoding.PEM),
                    mimetype="application/x-pem-file", headers={"Cache-Control": "no-cache"})
