"""``wheelhouse ca init|issue`` and ``wheelhouse verify-provenance`` against a running index.

The commands are invoked through click in this process: the shared test environment's
installed entry points may predate them (tests/wheelhouse/cli/test_main.py checks they are listed).
"""

from __future__ import annotations

import json
import stat
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from click.testing import CliRunner
from packaging.utils import canonicalize_name

from tests.helpers import make_wheel, start_index
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.cli.main import publish as publish_command
from wheelhouse.cli.provenance import ca_group, verify_provenance
from wheelhouse.config import Config
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.proofs import GpuProof, now, record_proof, sign_proof
from wheelhouse.index.publish import bump_generation, publish
from wheelhouse.index.storage import open_storage
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.variants import parse_variant

V = parse_variant("torch2.14-cu130")


def test_ca_init_and_issue(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(ca_group, ["init", str(tmp_path / "ca")])
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
    again = runner.invoke(ca_group, ["init", str(tmp_path / "ca")])
    assert again.exit_code == 1 and "already holds a CA" in again.output
    issued = runner.invoke(ca_group, ["issue", "worker-7", "--ca-dir", str(tmp_path / "ca"),
                                      "--out", str(tmp_path / "out"), "--days", "3"])
    assert issued.exit_code == 0, issued.output
    assert f"WHEELHOUSE_PROVENANCE_CERT={tmp_path / 'out' / 'worker-7.pem'}" in issued.output
    out = tmp_path / "out"
    identity = ca.load_identity(out / "worker-7.pem", out / "worker-7.key")
    assert identity.name == "worker-7"
    identity.cert.verify_directly_issued_by(ca.load_ca(tmp_path / "ca").cert)
    assert stat.S_IMODE((tmp_path / "out" / "worker-7.key").stat().st_mode) == 0o600


def _publish_built(config: Config, tmp_path: Path) -> Path:
    identity = ca.signer_for(config, "worker")
    facts = BuildFacts(build_id="b-1", recipe="generic", host="box", toolkit="V13.0.48",
                       torch="2.14.1+cu130", sdist_url="https://files.example/demo-1.0.tar.gz",
                       sdist_sha256="ef" * 32, seconds=3.0)

    def sign(filename: str, sha256: str) -> bytes:
        predicate = predicates.build(project="demo", version="1.0", python="3.12",
                                     machine="x86_64", variant=V, archs=None, facts=facts,
                                     signer=identity.name, finished=datetime.now(UTC))
        return attest.document([attest.Bundle({"kind": "wheelhouse-worker"}, (attest.sign(
            identity, filename, sha256, predicates.SLSA_PROVENANCE, predicate),))])

    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    publish(open_storage(config), wheel, V, build=facts, sign=sign)
    return wheel


def test_verify_provenance_tells_where_a_wheel_came_from_or_why_not(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "ws"),
                    upstream="off")
    wheel = _publish_built(config, tmp_path)
    runner = CliRunner()
    with start_index(config, tmp_path) as url:
        root = f"{url}/{V.key}/simple/"
        url_of_wheel = f"{url}/files/{V.key}/demo/{wheel.name}"
        by_url = runner.invoke(verify_provenance, [url_of_wheel])
        assert by_url.exit_code == 0, by_url.output
        assert "built by worker on box (build b-1" in by_url.output
        assert f"from sdist: https://files.example/demo-1.0.tar.gz (sha256 {'ef' * 32})" \
            in by_url.output
        by_file = runner.invoke(verify_provenance, [str(wheel), "--index", root,
                                                    "--ca", str(tmp_path / "ws" / "provenance"
                                                                / "ca.pem")])
        assert by_file.exit_code == 0, by_file.output
        assert by_file.output.splitlines()[0].endswith("verifies against 'wheelhouse fleet CA'")

        changed = tmp_path / "changed" / wheel.name
        changed.parent.mkdir()
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(changed, "w") as dst:
            for item in src.infolist():
                data = src.read(item)
                dst.writestr(item, data + b"\n" if item.filename.endswith(".py") else data)
        refused = runner.invoke(verify_provenance, [str(changed), "--index", root])
        assert refused.exit_code == 1
        assert len(refused.output.strip().splitlines()) == 1
        assert "not " + wheel.name + " with sha256" in refused.output

        other = ca.init_ca(tmp_path / "other", "another fleet")
        assert other.cert
        foreign = runner.invoke(verify_provenance, [url_of_wheel, "--ca",
                                                    str(tmp_path / "other" / "ca.pem")])
        assert foreign.exit_code == 1
        assert "not issued by the fleet CA 'another fleet'" in foreign.output


def test_wheelhouse_publish_attests_what_it_publishes(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "ws"),
                    upstream="off")
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    done = CliRunner().invoke(publish_command, [str(wheel), "--variant", V.key], obj=config)
    assert done.exit_code == 0, done.output
    storage = open_storage(config)
    record = Catalog(storage, 0).files(V, canonicalize_name("demo"))[0]
    (verified,) = attest.verify_document(storage.get_bytes(record.provenance_key),
                                         ca.ca_cert_for(config), wheel.name, record.sha256)
    assert verified.signer == "index"
    assert str(verified.predicate["publisher"]).startswith("wheelhouse publish by ")


def test_verify_provenance_checks_the_gpu_proof_served_beside_it(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "ws"),
                    upstream="off", catalog_refresh_seconds=0.0)
    wheel = _publish_built(config, tmp_path)
    storage = open_storage(config)
    (record,) = Catalog(storage, 0).files(V, canonicalize_name("demo"))
    runner = CliRunner()
    with start_index(config, tmp_path) as url:
        url_of_wheel = f"{url}/files/{V.key}/demo/{wheel.name}"
        unproven = runner.invoke(verify_provenance, [url_of_wheel])
        assert unproven.exit_code == 0, unproven.output
        assert unproven.output.splitlines()[-1] == "  not proven on a GPU"

        proof = GpuProof(filename=record.filename, sha256=record.sha256, proven=True,
                         passed=True, reason="ok", gpu="NVIDIA H100 80GB HBM3", capability="90",
                         driver="580.65", cuda="13.0", torch="2.14.1", proof="generic",
                         seconds=2.0, proven_at=now(), host="ops@gpu1 (cli)")
        record_proof(storage, record, sign_proof(proof, ca.signer_for(config, "prover")))
        proven = runner.invoke(verify_provenance, [str(wheel), "--index",
                                                   f"{url}/{V.key}/simple/"])
        assert proven.exit_code == 0, proven.output
        line = proven.output.splitlines()[-1]
        assert line.startswith("  GPU proof: proven on NVIDIA H100 80GB HBM3 (sm_90), driver "
                               "580.65, CUDA 13.0, torch 2.14.1 (generic proof, 2.0 s, ")
        assert line.endswith("on ops@gpu1 (cli)), by prover")

        # Edited in storage after signing: a failure, in one line, as any other.
        data = json.loads(storage.get_bytes(record.proof_key))
        data["passed"] = True
        data["gpu"] = "NVIDIA B200"
        storage.put_bytes(record.proof_key, json.dumps(data).encode())
        bump_generation(storage)
        refused = runner.invoke(verify_provenance, [url_of_wheel])
        assert refused.exit_code == 1
        assert len(refused.output.strip().splitlines()) == 1
        assert refused.output.startswith("Error: provenance does not verify: the GPU proof of "
                                         f"{wheel.name} was changed after 'prover' signed it: "
                                         "gpu is 'NVIDIA B200' in the proof")
