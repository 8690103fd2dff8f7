"""The gpt suite's anchor (bench/suites/gpt_anchor.py, gpt.py): the plain model cut by peerline's stage split,
its stages built from the whole model's weights, and which blocks (eager, compiled) the anchor tries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peerline.bench.suites.gpt import anchor_blocks
from peerline.bench.suites.gpt_anchor import GPTShape, StageCache, TorchGPTAnchor, gpt_split
from peerline.bench.suites.plain_gpt import PlainGPT
from peerline.distributed.assemble import make_model
from peerline.distributed.config import RunConfig
from tests.unit.test_gpt_config import counting_feed  # noqa: F401 - the feed the RunConfig below names

FEED = f"{__name__}:counting_feed"


def shape(layers: int, hidden: int) -> GPTShape:
    return GPTShape("t", layers=layers, hidden=hidden, heads=4, seq=16, micro_batch_size=2, microbatches=4,
                    dtype="fp32")


@pytest.mark.parametrize(("layers", "hidden", "n_stages"), [(2, 32, 2), (5, 32, 3), (6, 16, 4), (3, 64, 5)])
def test_the_plain_model_is_cut_where_peerline_cuts_its_gpt(layers, hidden, n_stages):
    cfg = RunConfig(model="gpt", data=FEED, layers=layers, hidden=hidden, heads=4, seq=16, micro_batch_size=2,
                    device="cpu")
    work = make_model(cfg, SimpleNamespace(n_stages=n_stages, stage_ids=list(range(n_stages))), "torch")
    assert gpt_split(shape(layers, hidden), work.vocab, n_stages) == work.bounds


def test_plain_stages_hold_the_whole_models_weights():
    s = shape(4, 32)
    stages = StageCache(s, 97, "plain").modules(4, [0, 1, 2, 3])
    whole = PlainGPT(vocab=97, hidden=32, heads=4, layers=4, seq=16, seed=s.seed).state_dict()
    split = {k: v for m in stages for k, v in m.state_dict().items()}
    assert split.keys() == whole.keys() and all(torch.equal(split[k], whole[k]) for k in whole)


def test_only_the_plain_model_compiles_its_blocks():
    with pytest.raises(ValueError, match="unknown anchor model"):
        StageCache(shape(2, 32), 97, "nanogpt")
    peerline = StageCache(shape(2, 32), 97, "peerline")
    with pytest.raises(ValueError, match="compiled blocks are the plain model's"):
        TorchGPTAnchor(peerline, lambda *a: None, "1f1b", "fp32", 1, 0, torch.device("cpu"), "compiled")


def test_the_anchors_blocks_default_to_both_on_a_gpu_and_eager_on_the_cpu():
    notes: list[str] = []
    ctx = lambda kind: SimpleNamespace(device=torch.device(kind), note=notes.append)  # noqa: E731
    args = lambda choice: SimpleNamespace(gpt_anchor_compile=choice)  # noqa: E731
    assert anchor_blocks(args(None), ctx("cuda")) == ["eager", "compiled"] and not notes
    assert anchor_blocks(args(None), ctx("cpu")) == ["eager"] and "--gpt-anchor-compile" in notes[0]
    assert anchor_blocks(args("on"), ctx("cpu")) == ["compiled"]
    assert anchor_blocks(args("off"), ctx("cuda")) == ["eager"]
    assert anchor_blocks(args("both"), ctx("cpu")) == ["eager", "compiled"] and len(notes) == 1
