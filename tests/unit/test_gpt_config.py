"""The GPT workload's configuration, token feed, loss checks, tied weights and progress line, on the CPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from peerline.distributed.assemble import LayerProbe, check_logits
from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.data.sampler import TokenSampler
from peerline.distributed.data.token_feed import TokenFeed, make_token_feed, token_data
from peerline.distributed.grad_sync.tied import TiedGradSum
from peerline.distributed.model import build_stages, make_loss
from peerline.distributed.observe.progress import format_stats
from peerline.distributed.pipeline.recompute import RecomputeSequential, with_recompute
from tests.helpers import PIPELINE, cpu_env, run_command

REPO = Path(__file__).resolve().parents[2]
MODELS = str(REPO / "tests" / "multiproc" / "models")


def test_defaults_follow_the_model() -> None:
    gpt = RunConfig(model="gpt")
    assert (gpt.data, gpt.loss, gpt.token_data, gpt.recompute_layers) == ("text", "cross-entropy", True, 0)
    mlp = RunConfig()
    assert (mlp.data, mlp.loss, mlp.token_data) == ("seeded", "mse", False)
    assert RunConfig(model="pkg.mod:f", data="pkg.feed:make").loss == "cross-entropy"
    assert RunConfig(recompute="full").recompute_layers is None and RunConfig(recompute="3").recompute_layers == 3
    assert RunConfig(**RunConfig(model="gpt").to_dict()) == RunConfig(model="gpt")  # the --json record round-trips


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "gpt", "heads": 3}, "--heads 3 must divide --hidden 128"),
    ({"model": "gpt", "hidden": 12, "heads": 4}, "heads of an even width"),
    ({"tie_embeddings": True}, "--tie-embeddings needs --model gpt"),
    ({"recompute": "some"}, "--recompute must be off, full or a number of layers N >= 0, got 'some'"),
    ({"recompute": "-1"}, "--recompute must be off, full"),
    ({"model": "gpt", "data": "seeded"}, "--model gpt reads token ids: --data seeded makes floats"),
    ({"model": "gpt", "loss": "mse"}, "--loss mse needs float targets"),
    ({"loss": "cross-entropy"}, "--loss cross-entropy needs token labels"),
    ({"loss": "nonsense"}, "--loss 'nonsense' must be mse, cross-entropy or look like"),
    ({"model": "bert"}, "--model 'bert' must be gpt or look like 'package.module:factory'"),
    ({"model": "gpt", "staging": "pinned"}, "--staging pinned applies to synthetic data"),
    ({"model": "gpt", "graph_loop": 2}, "--graph-loop needs --data seeded or counter"),
    ({"vocab": 1}, "--vocab must be >= 2"),
    ({"heads": 0}, "--heads must be >= 1"),
])
def test_bad_workload_is_one_config_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kwargs)


def test_missing_data_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        token_data(RunConfig(model="gpt", data=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match="cannot load data feed 'no_such_module:feed'"):
        token_data(RunConfig(model="gpt", data="no_such_module:feed"))


def counting_feed(seq: int, micro_batch_size: int):
    """A user feed (factory taking what it names): token t of row r of microbatch g at iteration i is
    (i * 7 + g * 5 + r * 3 + t) % 97."""

    def fill(inputs: torch.Tensor, labels: torch.Tensor, iteration: int, global_mb: int) -> None:
        base = torch.arange(seq + 1) + iteration * 7 + global_mb * 5
        rows = torch.stack([(base + 3 * r) % 97 for r in range(micro_batch_size)])
        inputs.copy_(rows[:, :-1])
        labels.copy_(rows[:, 1:])

    return SimpleNamespace(fill=fill, vocab=97)


def test_user_feed_and_token_feed_fill_the_static_buffers() -> None:
    cfg = RunConfig(model="gpt", data=f"{__name__}:counting_feed", seq=8, micro_batch_size=2, hidden=16)
    data = token_data(cfg)
    assert data.vocab == 97
    feed = make_token_feed(data, seed=0, replica=1, microbatches=3, micro_batch_size=2, seq=8,
                           device=torch.device("cpu"), holds_first=True, holds_last=True)
    addresses = [b.data_ptr() for b in feed.inputs + feed.targets]
    feed.load(4)
    for mb in range(3):
        want_in, want_lab = torch.empty(2, 8, dtype=torch.int64), torch.empty(2, 8, dtype=torch.int64)
        data.fill(want_in, want_lab, 4, 1 * 3 + mb)  # replica 1's microbatch mb is global microbatch 3 + mb
        assert torch.equal(feed.inputs[mb], want_in) and torch.equal(feed.targets[mb], want_lab)
    assert feed.inputs[0].dtype == torch.int64 and [b.data_ptr() for b in feed.inputs + feed.targets] == addresses
    middle = make_token_feed(data, seed=0, replica=0, microbatches=3, micro_batch_size=2, seq=8,
                             device=torch.device("cpu"), holds_first=False, holds_last=False)
    middle.load(1)  # a middle stage's rank reads no tokens
    assert middle.inputs == [] and middle.targets == []


def test_token_feed_over_a_sampler_gives_the_sampler_batch() -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 251
    sampler = TokenSampler(tokens, seq=16, micro_batch_size=2, seed=3)
    inputs = [torch.empty(2, 16, dtype=torch.int64)]
    feed = TokenFeed(fill=sampler.fill, seed=3, replica=0, microbatches=1, shape=(2, 16), inputs=inputs, targets=[])
    feed.load(5)
    assert torch.equal(inputs[0], sampler.batch(5, 0)[0])


def test_a_layer_that_does_not_fit_is_named_in_one_line() -> None:
    probe = LayerProbe(nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4)), first_layer=3)
    with pytest.raises(ConfigError, match=r"layer 4 \(Embedding\) got float32 \[2, 4\]: RuntimeError") as e:
        probe(torch.zeros(2, 4))
    assert "\n" not in str(e.value)


def test_logits_must_cover_the_vocabulary() -> None:
    cfg = RunConfig(model="gpt", seq=8, micro_batch_size=2)
    check_logits(torch.empty(2, 8, 100), cfg, 100)
    with pytest.raises(ConfigError, match="fewer than the data's vocabulary of 512"):
        check_logits(torch.empty(2, 8, 100), cfg, 512)
    with pytest.raises(ConfigError, match=r"int64 \[2, 8\] cannot be scored by cross-entropy"):
        check_logits(torch.empty(2, 8, dtype=torch.int64), cfg, 10)


def test_losses() -> None:
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    want = torch.nn.functional.cross_entropy(logits.reshape(6, 5), labels.reshape(6))
    assert torch.equal(make_loss("cross-entropy")(logits, labels), want)
    assert make_loss("torch.nn.functional:l1_loss") is torch.nn.functional.l1_loss
    with pytest.raises(ConfigError, match="cannot load loss function"):
        make_loss("no_such_module:loss")


def test_recompute_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)]
    plain, recomputed = nn.Sequential(*layers), with_recompute(nn.Sequential(*layers), 2)
    assert isinstance(recomputed, RecomputeSequential) and recomputed.state_dict().keys() == plain.state_dict().keys()
    assert with_recompute(plain, 0) is plain
    x = torch.randn(4, 8)
    grads = []
    for model in (plain, recomputed):
        model.zero_grad()
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_tied_gradients_are_summed_locally() -> None:
    a, b = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3, 2))
    a.grad, b.grad = torch.full((3, 2), 1.5), torch.full((3, 2), 2.0)
    TiedGradSum([a, b], None)()
    assert torch.equal(a.grad, torch.full((3, 2), 3.5)) and torch.equal(b.grad, a.grad)
    with pytest.raises(ValueError, match="one copy needs the group"):
        TiedGradSum([a], None)


def test_tied_embedding_and_head_stay_equal_on_one_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from peerline.distributed.runtime import Runtime
    from peerline.models.gpt import embedding_init

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    cfg = RunConfig(model="gpt", data=f"{__name__}:counting_feed", layers=1, hidden=16, heads=2, seq=8, iters=2,
                    tie_embeddings=True, device="cpu", microbatches=2)
    rt = Runtime.create(cfg)
    try:
        rt.train()
        stage = rt.engine.stages[0].module
        assert torch.equal(stage[0].weight, stage[-1].out.weight)
        assert not torch.equal(stage[0].weight, embedding_init(97, 16, 0))  # trained, and equal all along
    finally:
        rt.close()


def test_user_model_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(MODELS)
    notices: list[str] = []
    cfg = RunConfig(model="lm_models:dropout_lm", data="x.feed:f", layers=3)
    stages, bounds = build_stages(cfg, 1, [0], "torch", 50, notices)
    assert bounds == [(0, 3)] and stages[0][0].weight.shape == (50, 16)
    assert notices[0].startswith("--layers not applied") and "dropout" in notices[1]


def test_progress_line() -> None:
    gpu = SimpleNamespace(iteration=2, loss=math.log(100), ms=1.5, tokens_per_s=1e6, peak_mem_gb=3.25, ppl=100.0,
                          tflops=412.0, mfu=41.6, peak_mem_gb_per_rank=[3.0, 3.25])
    assert format_stats(gpu, 5) == ("iter 2/5 | loss 4.605170 | ppl 100.00 | 1.50 ms/iter | 1,000,000 tokens/s | "
                                    "412 TFLOP/s | MFU 41.6% | peak 3.00-3.25 GiB")
    one_rank = SimpleNamespace(**{**vars(gpu), "peak_mem_gb_per_rank": [3.25]})
    assert format_stats(one_rank, 5).endswith("| MFU 41.6% | peak 3.25 GiB")
    cpu = SimpleNamespace(iteration=1, loss=0.5, ms=2.0, tokens_per_s=10.0, peak_mem_gb=0.0, ppl=None, tflops=None,
                          mfu=None, peak_mem_gb_per_rank=None)
    assert format_stats(cpu, 1) == "iter 1/1 | loss 0.500000 | 2.00 ms/iter | 10 tokens/s"


@pytest.mark.parametrize("args,line", [
    (["--model", "lm_models:float_lm", "--data", "tests_feed_unused_dir"],
     "peerline: error: text data: tests_feed_unused_dir does not exist"),
    (["--model", "lm_models:embedding_lm"],
     "peerline: error: the model does not fit its input: layer 0 (Embedding) got float32 [2, 64, 128]: "),
    (["--model", "lm_models:float_lm", "--data", "tests.unit.test_gpt_config:counting_feed", "--seq", "8"],
     "peerline: error: the model does not fit its input: layer 0 (Linear) got int64 [2, 8]: "),
])
def test_bad_model_or_data_is_one_line_exit_2(tmp_path: Path, args: list[str], line: str) -> None:
    env = cpu_env(PYTHONPATH=f"{MODELS}:{REPO}")
    # forked from the test fork server (tests/forkjob.py): the job's checks are the subject, not its start-up
    run = run_command([sys.executable, PIPELINE, *args, "--iters", "1"], tmp_path, env, timeout=120)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith(line), run.stderr


def test_the_gpt_split_names_embedding_blocks_and_head() -> None:
    from peerline.models.gpt import describe_gpt_split

    # --layers 4 is 4 blocks; the embedding and the head are layers of the split too, now named as such
    assert describe_gpt_split([(0, 4), (4, 6)], 4) == "stage 0: embedding, blocks 0-2; stage 1: block 3, LM head"
    assert describe_gpt_split([(0, 1), (1, 5), (5, 6)], 4) == \
        "stage 0: embedding; stage 1: blocks 0-3; stage 2: LM head"
    assert describe_gpt_split([(0, 6)], 4) == "stage 0: embedding, blocks 0-3, LM head"


def test_the_start_line_names_the_model_the_data_and_the_vocabulary(tmp_path: Path) -> None:
    from peerline.distributed.assemble import Workload, describe_workload

    cfg = RunConfig(model="gpt", data=f"{__name__}:counting_feed", layers=4, hidden=32, heads=2, seq=8)
    work = Workload(modules=[], bounds=[(0, 4), (4, 6)], vocab=97, tokens=token_data(cfg), flops_per_token=None,
                    notices=[])
    assert describe_workload(cfg, work) == (f"model gpt (4 blocks, hidden 32, 2 heads, seq 8); data feed "
                                            f"{__name__}:counting_feed; vocabulary 97")
    plain = Workload(modules=[], bounds=[(0, 8)], vocab=4096, tokens=None, flops_per_token=None, notices=[])
    assert describe_workload(RunConfig(), plain) == "model residual MLP (8 blocks, hidden 128); data seeded " \
                                                    "(synthetic floats)"
    path = tmp_path / "t.bin"
    np.array([1, 2, 3] * 40, dtype=np.uint16).tofile(path)
    named = token_data(RunConfig(model="gpt", data=str(path), seq=8, micro_batch_size=2)).name
    assert named == f"token file {path} (120 ids)"
