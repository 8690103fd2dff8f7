"""tools/gpu_probes/gpt_block_host_probe.py runs its calls on the CPU (the GPU figures need a GPU): every figure
is there, positive and finite, so the probe keeps running where no GPU checks it."""

import math
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
