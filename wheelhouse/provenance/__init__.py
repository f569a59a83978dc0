"""Signed provenance (PEP 740) under the fleet's own certificate authority.

- :mod:`wheelhouse.provenance.ca`: the fleet CA and the short-lived certificates it issues to
  workers and the index (``wheelhouse ca``); on one box, a CA made in the workspace.
- :mod:`wheelhouse.provenance.attest`: PEP 740 attestations (a DSSE envelope over an in-toto v1
  Statement), the provenance document served as ``<file>.provenance``, and their verification.
- :mod:`wheelhouse.provenance.predicates`: what a build, an upload or a GPU proof says it did
  (SLSA Provenance v1, a publish attestation, a GPU proof attestation; the last is signed and
  checked with the proof, :mod:`wheelhouse.index.proofs`).
"""
