"""The gpt suite's anchor model (bench/suites/plain_gpt.py), a GPT written with plain torch modules: the same
parameters and FLOPs per token as peerline's --model gpt, the same function once peerline's weights are loaded
(q and k rows permuted from rotate-half to complex pairs), any split starting from the whole model's weights,
the RoPE table kept complex64 under a bf16 cast, and every block capturable whole by torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from peerline.bench.suites.plain_gpt import PlainGPT, compile_blocks, cross_entropy_loss
from peerline.models.flops import gpt_matmul_params
from peerline.models.gpt import build_gpt_layers

SIZES = {"vocab": 96, "hidden": 32, "heads": 4, "layers": 3, "seq": 16}


def peerline_gpt(**kw) -> torch.nn.Sequential:
    return torch.nn.Sequential(*build_gpt_layers(**{**SIZES, **kw}, seed=0, kernels="torch"))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tokens(batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SIZES["vocab"], (batch, SIZES["seq"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_same_parameter_count_as_peerlines_gpt():
    assert n_params(PlainGPT(**SIZES)) == n_params(peerline_gpt())
    sizes = {**SIZES, "hidden": 64, "heads": 8, "layers": 5}
    assert n_params(PlainGPT(**sizes)) == sum(p.numel() for m in build_gpt_layers(**sizes, seed=0, kernels="torch")
                                              for p in m.parameters())


class AttentionCalls(TorchDispatchMode):
    """The attention ops (forward and backward) that reach the dispatcher, with their arguments (tensors as their
    shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if "scaled_dot_product" in func.__name__:
            shape = lambda a: tuple(a.shape) if isinstance(a, torch.Tensor) else a
            named = {k: shape(v) for k, v in (kwargs or {}).items()}
            self.calls.append((func.__name__, [shape(a) for a in args], named))
        return func(*args, **(kwargs or {}))


def train_flops(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[int, list]:
    """The matmul FLOPs of one forward and backward (torch's counter), and the attention calls (the counter has no
    formula for the CPU's attention op: their shapes fix their FLOPs)."""
    with FlopCounterMode(display=False) as counter, AttentionCalls() as attention:
        cross_entropy_loss(model(ids), labels).backward()
    return counter.get_total_flops(), attention.calls


def test_same_flops_per_token_as_peerlines_gpt():
    ids, labels = tokens()
    (plain, plain_attn), (theirs, theirs_attn) = (train_flops(PlainGPT(**SIZES), ids, labels),
                                                  train_flops(peerline_gpt(), ids, labels))
    matmuls = 6 * gpt_matmul_params(vocab=SIZES["vocab"], hidden=SIZES["hidden"], layers=SIZES["layers"])
    assert plain == theirs and plain >= matmuls * ids.numel(), (plain / ids.numel(), matmuls)
    batch, hd = ids.shape[0], SIZES["hidden"] // SIZES["heads"]
    qkv = [(batch, SIZES["heads"], SIZES["seq"], hd)] * 3
    assert plain_attn == theirs_attn and len(plain_attn) >= SIZES["layers"], (plain_attn, theirs_attn)
    name, args, kwargs = plain_attn[0]
    assert args[:3] == qkv and (kwargs.get("is_causal") or True in args[3:]), plain_attn[0]


def load_peerlines_weights(plain: PlainGPT, layers: list[torch.nn.Module], heads: int) -> None:
    """peerline's weights into the plain model; q and k rows reordered so plain dims (2j, 2j+1) are peerline's
    rotate-half pair (j, j + head_dim / 2)."""
    hidden = layers[0].weight.shape[1]
    hd = hidden // heads
    perm = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], dim=1).flatten()
    rows = torch.cat([h * hd + perm for h in range(heads)])
    qkv_rows = torch.cat([rows, hidden + rows, torch.arange(2 * hidden, 3 * hidden)])
    with torch.no_grad():
        plain.tok_embeddings.weight.copy_(layers[0].weight)
        for i, block in enumerate(layers[1:-1]):
            mine = plain.layers[str(i)]
            mine.attention_norm.load_state_dict(block.norm1.state_dict())
            mine.ffn_norm.load_state_dict(block.norm2.state_dict())
            mine.attention.qkv.weight.copy_(block.qkv.weight[qkv_rows])
            mine.attention.proj.weight.copy_(block.proj.weight)
            mine.feed_forward.fc1.weight.copy_(block.fc1.weight)
            mine.feed_forward.fc1.bias.copy_(block.fc1_bias)
            mine.feed_forward.fc2.weight.copy_(block.fc2.weight)
            mine.feed_forward.fc2.bias.copy_(block.fc2.bias)
        plain.norm.load_state_dict(layers[-1].norm.state_dict())
        plain.output.weight.copy_(layers[-1].out.weight)


def test_same_function_as_peerlines_gpt_with_its_weights():
    theirs = peerline_gpt()
    for block in theirs[1:-1]:  # non-zero LayerNorm and bias parameters, so a swapped one would show
        with torch.no_grad():
            for p in (block.norm1.weight, block.norm1.bias, block.fc1_bias, block.fc2.bias):
                p.add_(torch.randn_like(p) * 0.1)
    plain = PlainGPT(**SIZES)
    load_peerlines_weights(plain, list(theirs), SIZES["heads"])
    ids, labels = tokens()
    torch.testing.assert_close(plain(ids).float(), theirs(ids), rtol=1e-4, atol=1e-5)
    cross_entropy_loss(plain(ids), labels).backward()
    cross_entropy_loss(theirs(ids), labels).backward()
    torch.testing.assert_close(plain.layers["1"].feed_forward.fc1.weight.grad, theirs[2].fc1.weight.grad,
                               rtol=1e-3, atol=1e-6)


def test_any_split_starts_from_the_whole_models_weights():
    whole = PlainGPT(**SIZES, seed=3)
    parts = [PlainGPT(**SIZES, seed=3, start=a, stop=b) for a, b in ((0, 2), (2, 4), (4, 5))]
    assert parts[0].norm is None and parts[1].tok_embeddings is None and parts[2].freqs_cis is None
    split = {k: v for part in parts for k, v in part.state_dict().items()}
    assert split.keys() == whole.state_dict().keys()
    for name, value in whole.state_dict().items():
        assert torch.equal(value, split[name]), name
    ids, _ = tokens()
    h = ids
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, whole(ids))
    with pytest.raises(ValueError, match="layer range"):
        PlainGPT(**SIZES, start=2, stop=2)


def test_bf16_cast_keeps_the_rope_table_complex():
    model = PlainGPT(**SIZES).to(dtype=torch.bfloat16)
    assert model.freqs_cis.dtype == torch.complex64 and model.layers["0"].attention.qkv.weight.dtype == torch.bfloat16
    ids, labels = tokens()
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    loss = cross_entropy_loss(logits, labels)
    assert abs(loss.item() - torch.log(torch.tensor(float(SIZES["vocab"]))).item()) < 0.1


def test_tied_head_shares_the_embedding():
    model = PlainGPT(**SIZES, tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert n_params(model) == n_params(PlainGPT(**SIZES)) - SIZES["vocab"] * SIZES["hidden"]
    with pytest.raises(ValueError, match="tied embeddings"):
        PlainGPT(**SIZES, stop=3, tie_embeddings=True)


def test_compiled_blocks_are_one_graph_each_and_compute_the_same():
    """fullgraph=True raises on a graph break. aot_eager traces forward and backward as inductor would, without
    compiling C++ (inductor itself runs on the GPUs: the suite's --gpt-anchor-compile)."""
    torch._dynamo.reset()
    eager = PlainGPT(**SIZES)
    compiled = compile_blocks(PlainGPT(**SIZES), backend="aot_eager")
    assert type(compiled.layers["0"]).__name__ == "OptimizedModule"
    ids, labels = tokens()
    for model in (eager, compiled):
        cross_entropy_loss(model(ids), labels).backward()
    torch.testing.assert_close(compiled(ids), eager(ids))
    grads = [m.layers["2"].attention.qkv.weight.grad for m in (compiled, eager)]
    torch.testing.assert_close(*grads)
    torch._dynamo.reset()
