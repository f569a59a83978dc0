"""The GPU proof's program: run in the wheel's own Python, after its libraries loaded.

``python -I -c SOURCE PAYLOAD`` (``worker.gpuproof``): standard library and torch only, any
Python from 3.9, nothing of wheelhouse (it is not installed there). PAYLOAD is JSON:
``{"archs": ["80", "90"], "proof": "generic"}``, the SASS architectures the wheel holds and the
named proof of its recipe. It prints one line, ``wheelhouse-proof {JSON}``: the GPU, its compute
capability, the driver, torch, pass or fail, the seconds and a one-line reason; the exit code is
0 (passed), 1 (failed) or 3 (no GPU visible: nothing was proven).

Proofs are code of the product, named by recipes (a recipe runs no code of its own):
``generic`` checks that the GPU's architecture is among the wheel's SASS and runs a kernel of
torch's own on it; ``flash-attn`` then runs ``flash_attn_func`` forward and backward against a
reference attention on small tensors, in fp16 and bf16.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import sys
import time
from typing import Any

NO_GPU = 3
MARK = "wheelhouse-proof "


def _arch(capability: Any) -> str:
    return f"{capability[0]}{capability[1]}"


def _covered(arch: str, archs: list[str]) -> bool:
    """SASS for ``arch`` (``90`` is also met by ``90a``); SASS runs on its own major only."""
    return arch in archs or f"{arch}a" in archs


def _driver_version() -> str:
    """The CUDA driver's version (``13.0``) as libcuda reports it, or ``""``."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return ""
    except OSError:
        return ""
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _reference_attention(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> Any:
    """softmax(QKᵀ/√d)V in fp32, over (batch, seqlen, heads, dim) tensors as flash_attn takes."""
    q32, k32, v32 = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = q32 @ k32.transpose(-2, -1) / (q.shape[-1] ** 0.5)
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v32).transpose(1, 2)


def _flash_attn(torch: Any) -> str:
    flash_attn = importlib.import_module("flash_attn")
    checked = []
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=dtype,
                                   requires_grad=True) for _ in range(3))
            out = flash_attn.flash_attn_func(q, k, v, causal=causal)
            ref = _reference_attention(torch, q, k, v, causal)
            tolerance = 2e-2 if dtype == torch.float16 else 6e-2
            error = (out.float() - ref).abs().max().item()
            if not error <= tolerance:
                raise AssertionError(f"forward {dtype} causal={causal}: max error {error:.3g}")
            grad = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), grad)
            want = torch.autograd.grad(ref, (q, k, v), grad.float())
            for name, a, b in zip("qkv", got, want):
                gerr = (a.float() - b.float()).abs().max().item()
                scale = b.float().abs().max().item() or 1.0
                if not gerr <= 5 * tolerance * max(1.0, scale):
                    raise AssertionError(f"backward d{name} {dtype} causal={causal}: "
                                         f"max error {gerr:.3g}")
            checked.append(f"{str(dtype).removeprefix('torch.')}{' causal' if causal else ''}")
    return "flash_attn_func forward and backward match the reference (" + ", ".join(
        checked) + ")"


def _generic(torch: Any) -> str:
    a = torch.arange(1024, device="cuda", dtype=torch.float32)
    if float((a * 2).sum().item()) != float(1023 * 1024):
        raise AssertionError("a torch kernel on the GPU computed a wrong sum")
    return "the libraries loaded and a kernel ran on the GPU"


PROOFS = {"generic": _generic, "flash-attn": _flash_attn}


def main(argv: list[str]) -> int:
    payload = json.loads(argv[1])
    archs, proof = [str(a) for a in payload["archs"]], str(payload["proof"])
    if payload.get("site"):  # the wheel installed there, ahead of the venv's own packages
        sys.path.insert(0, str(payload["site"]))
    result: dict[str, Any] = {"passed": False, "proof": proof}
    started = time.monotonic()
    code = 1
    try:
        torch: Any = importlib.import_module("torch")
        result["torch"] = str(torch.__version__)
        if not torch.cuda.is_available():
            result["reason"] = "no GPU visible to torch: nothing was proven"
            code = NO_GPU
        else:
            arch = _arch(torch.cuda.get_device_capability())
            result.update(gpu=torch.cuda.get_device_name(), capability=arch,
                          driver=_driver_version(), cuda=str(torch.version.cuda or ""))
            if not _covered(arch, archs):
                result["reason"] = (f"the wheel holds SASS for {', '.join(archs) or 'nothing'}, "
                                    f"not this GPU's sm_{arch}")
            else:
                result["reason"] = PROOFS[proof](torch) if proof in PROOFS else _generic(torch)
                torch.cuda.synchronize()
                result["passed"] = True
                code = 0
    except BaseException as exc:  # the proof's own failure, in one line
        text = str(exc).strip().splitlines()
        result["reason"] = f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
        code = 1 if code != NO_GPU else code
    result["seconds"] = round(time.monotonic() - started, 2)
    sys.stdout.write("\n" + MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
