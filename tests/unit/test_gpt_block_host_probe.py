"""tools/gpu_probes/gpt_block_host_probe.py runs its calls on the CPU (the GPU figures need a GPU): every figure
is there, positive and finite, so the probe keeps running where no GPU checks it; so do its `--rope-parts` lines."""

import math
import os
import re
import subprocess
import sys

import torch

from tests.helpers import REPO


def test_the_probe_gives_every_figure_on_the_cpu() -> None:
    sys.path.insert(0, str(REPO / "tools" / "gpu_probes"))
    try:
        import gpt_block_host_probe as probe
    finally:
        sys.path.pop(0)
    got = probe.probe(hidden=32, heads=2, seq=8, batch=1, calls=2, device=torch.device("cpu"))
    assert {"peerline GPTBlock auto fwd+bwd", "peerline GPTBlock torch fwd+bwd",
            "plain TransformerBlock fwd+bwd"} <= set(got)
    assert sum(name.startswith("peerline auto fwd part: ") for name in got) == 7
    assert all(math.isfinite(us) and us > 0 for us in got.values()), got


def test_the_rope_parts_print_on_the_cpu_with_the_cuda_only_ones_skipped() -> None:
    """`--device cpu --rope-parts` prints every piece of FusedRopeAttention the CPU runs as `INFO rope part: <name>
    <us> us` (positive, finite), the CUDA-only pieces on one skipped line and none of them timed, and the derived
    differences as finite figures."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_probes" / "gpt_block_host_probe.py"),
                           "--device", "cpu", "--rope-parts", "--hidden", "32", "--heads", "2", "--seq", "8",
                           "--batch", "1", "--calls", "2"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    parts = {m[1]: float(m[2]) for m in (re.fullmatch(r"INFO rope part: (.+) (\S+) us", ln) for ln in lines) if m}
    derived = {m[1]: float(m[2]) for m in (re.fullmatch(r"INFO rope derived: (.+) (\S+) us", ln) for ln in lines)
               if m}
    for piece in ("_check_kernel_shapes", "argument values", "rope_forward_(qkv5, cos, sin) whole", "resolve_backend(",
                  "runs_direct(", "attention forward", "attention backward", "rope_backward_pack",
                  "FusedRopeAttention.apply forward, no_grad", "FusedRopeAttention.apply forward, with grad",
                  "FusedRopeAttention.apply forward + backward"):
        assert any(name.startswith(piece) for name in parts), (piece, parts)
    assert all(math.isfinite(us) and us > 0 for us in parts.values()), parts
    skipped = [ln for ln in lines if ln.startswith("INFO rope parts skipped on cpu (CUDA only): ")]
    assert len(skipped) == 1, lines
    assert not any(name.startswith(("load_kernel", "launch.", "elementwise.")) for name in parts), parts
    assert len(derived) >= 3 and all(math.isfinite(us) for us in derived.values()), derived
