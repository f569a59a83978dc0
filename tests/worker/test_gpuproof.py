"""The GPU proof (issue 27): a program of the product's own, run in the wheel's Python, that
never claims a proof that did not run. This host has no GPU: the real run below shows that
nothing is claimed then; on a GPU host the same test checks the verdict names the GPU."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_console
from wheelhouse.errors import InvalidRecipe
from wheelhouse.recipes.book import GPU_PROOFS, available_recipes, parse_recipe
from worker import gpuproof, gpuproof_program

SOURCE = Path(gpuproof_program.__file__)


def test_the_program_needs_only_the_standard_library_and_torch() -> None:
    tree = ast.parse(SOURCE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert gpuproof.PROGRAM == SOURCE.read_text()


def test_recipes_name_a_proof_the_program_has() -> None:
    assert set(GPU_PROOFS) == set(gpuproof_program.PROOFS)
    recipes = available_recipes()
    assert recipes["flash-attn"].gpu_proof == "flash-attn"
    assert recipes["generic"].gpu_proof == "generic"


def test_a_recipe_naming_an_unknown_proof_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text('project = "x"\ngpu_proof = "import os; os.system(\'id\')"\n')
    with pytest.raises(InvalidRecipe, match="gpu_proof must be one of generic, flash-attn"):
        parse_recipe(bad)


@pytest.mark.nvcc
def test_prove_on_this_host(cudaext_sm80_wheel: Path, session_torch_python: Path) -> None:
    """The real command on a real wheel (the fixture extension, sm_80) in a real torch venv."""
    done = run_console("prove", str(cudaext_sm80_wheel), "--python",
                       str(session_torch_python), "--json")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sees_gpu = subprocess.run([str(session_torch_python), "-c",
                               "import torch, sys; sys.exit(0 if torch.cuda.is_available() "
                               "else 1)"], check=False).returncode == 0
    if not sees_gpu:
        assert done.returncode == 3, done.stdout + done.stderr
        assert result["proven"] is False and result["passed"] is False
        assert result["reason"] == "no GPU visible to torch: nothing was proven"
        assert result["torch"].startswith("2.14.1") and result["gpu"] == ""
    else:  # a GPU host: a verdict that names the GPU it ran on
        assert done.returncode in (0, 1), done.stdout + done.stderr
        assert result["proven"] is True and result["gpu"] and result["capability"]
        if result["capability"] != "80":
            assert result["passed"] is False and "not this GPU's" in result["reason"]


def test_record_names_a_wheel_not_published_here_before_anything_runs(tmp_path: Path) -> None:
    """``prove --record`` of a wheel this index does not hold: one line, exit 2, no install."""
    from click.testing import CliRunner

    from tests.helpers import make_wheel
    from wheelhouse.config import Config
    from worker.cli import prove_command

    wheel = make_wheel(tmp_path / "w", "demo", "1.0+cu128torch2.8")
    done = CliRunner().invoke(prove_command, [str(wheel), "--python", sys.executable, "--record",
                                              "--storage", str(tmp_path / "data")],
                              obj=Config(storage=str(tmp_path / "data")))
    assert done.exit_code == 2, done.output
    assert "is not published in this index" in done.output
    assert not (tmp_path / "data" / "proofs").exists()


@pytest.mark.nvcc
def test_record_on_a_host_without_a_gpu_records_nothing(
        cudaext_sm80_wheel: Path, session_torch_python: Path, tmp_path: Path) -> None:
    """The published fixture wheel proved with ``--record`` here: no GPU, exit 3, no proof."""
    from click.testing import CliRunner

    from wheelhouse.config import Config
    from wheelhouse.index.publish import publish
    from wheelhouse.index.storage import LocalStorage
    from wheelhouse.variants import parse_variant
    from worker.cli import prove_command

    storage = LocalStorage(tmp_path / "data")
    record = publish(storage, cudaext_sm80_wheel, parse_variant("torch2.14-cu130"),
                     relabel_wheel=True, variant_form=False)
    wheel = tmp_path / record.filename
    wheel.write_bytes(storage.get_bytes(record.wheel_key))
    done = CliRunner().invoke(prove_command, [str(wheel), "--python", str(session_torch_python),
                                              "--record"],
                              obj=Config(storage=str(tmp_path / "data"),
                                         workspace=str(tmp_path / "ws")))
    if done.exit_code in (0, 1):  # a GPU host: the proof ran, so it is kept, signed
        from wheelhouse.index.proofs import read_proof, verify_proof
        from wheelhouse.provenance.ca import ca_cert_for

        kept = read_proof(storage, record)
        assert kept is not None, done.output
        verify_proof(kept, ca_cert_for(Config(workspace=str(tmp_path / "ws"))))
        return
    assert done.exit_code == 3, done.output
    assert "nothing recorded: no GPU ran the proof" in done.output
    assert not storage.exists(record.proof_key)


def test_record_signs_the_proof_under_the_box_ca(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What ``prove --record`` does with a run that happened (the result of a GPU host's run,
    as ``gpuproof.prove`` returns it): the proof kept is signed, and verifies against the CA the
    workspace made on first use."""
    from tests.helpers import make_wheel
    from wheelhouse.config import Config
    from wheelhouse.index.proofs import read_proof, verify_proof
    from wheelhouse.index.publish import publish
    from wheelhouse.index.storage import LocalStorage
    from wheelhouse.provenance.ca import ca_cert_for
    from wheelhouse.variants import parse_variant
    from worker.cli import PROVER_SIGNER, _record

    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "ws"))
    storage = LocalStorage(tmp_path / "data")
    variant = parse_variant("torch2.8-cu128")
    record = publish(storage, make_wheel(tmp_path / "w", "demo", f"1.0+{variant.local_label}"),
                     variant)
    ran = gpuproof.Proof(proof="generic", proven=True, passed=False, reason="max error 0.3",
                         gpu="NVIDIA H100 80GB HBM3", capability="90", driver="580.65",
                         cuda="13.0", torch="2.8.0", seconds=3.5)
    _record(config, storage, [record], ran)
    assert f"of {record.filename} in {variant.key}, signed by {PROVER_SIGNER}" in \
        capsys.readouterr().err
    kept = read_proof(storage, record)
    assert kept is not None and kept.attestation is not None
    verified = verify_proof(kept, ca_cert_for(config))
    assert verified.signer == PROVER_SIGNER
    assert verified.predicate["passed"] is False and verified.predicate["gpu"] == ran.gpu
    assert verified.predicate["host"] == kept.host and "@" in kept.host
