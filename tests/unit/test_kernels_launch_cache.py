"""CPU tests of the lean launch path: the launch cache's keys, the per-card table (lookup, fallback rules) with a mocked
device name, the plan merge, the tuner's pure rules, the packed arguments. No CUDA: kernels are fakes."""

from __future__ import annotations

import ctypes
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peerline.kernels import card_table as ct
from peerline.kernels import compile as kc
from peerline.kernels import elementwise as ew
from peerline.kernels import launch, plan

pytestmark = pytest.mark.timeout(60)


def _fake_op(spec: kc.KernelSpec, device_index: int) -> kc.CompiledOp:
    k = SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + spec.op))
    return kc.CompiledOp(spec, device_index, k, k, k, 132, 2, {})


@pytest.fixture
def fake_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """kc.get_op builds fakes (counted), launches are recorded (grid, block, smem, packed values), L2 = 50 MB."""
    launched: list[tuple] = []
    builds: list[kc.KernelSpec] = []

    def get_op(spec: kc.KernelSpec, dev: int) -> kc.CompiledOp:
        builds.append(spec)
        return _fake_op(spec, dev)

    monkeypatch.setattr(kc, "get_op", get_op)
    monkeypatch.setattr(ew, "_l2_bytes", lambda index: 50 << 20)
    monkeypatch.setattr(ew, "launch_kernel",
                        lambda item, stream: launched.append((item.grid, item.block, item.smem, item.pack.current())))
    monkeypatch.setattr(launch, "raw_stream", lambda index: 0)
    monkeypatch.setattr(ew, "_CACHE", {})
    launched.append(builds)  # launched[0]: the builds
    return launched


def test_cache_key_per_dtype_size_and_alignment(fake_launches: list) -> None:
    builds = fake_launches[0]
    rows = random.randint(3, 40)
    x, y = torch.randn(rows, 512), torch.randn(rows, 512)
    out = ew.residual_add_forward(x, y)
    assert out.shape == x.shape and len(ew._CACHE) == 1 and len(builds) == 1
    grid, block, smem, vals = fake_launches[-1]
    assert vals[:3] == (x.data_ptr(), y.data_ptr(), out.data_ptr()) and vals[3] == x.numel()
    x2, y2 = torch.randn(rows, 512), torch.randn(rows, 512)
    out2 = ew.residual_add_forward(x2, y2)  # same key: no new decision, fresh pointers in the packed arguments
    assert len(ew._CACHE) == 1 and len(builds) == 1
    assert fake_launches[-1][3][:3] == (x2.data_ptr(), y2.data_ptr(), out2.data_ptr())
    ew.residual_add_forward(torch.randn(rows * 512 + 1)[1:].view(rows, 512), y2)  # x off by one element: new class
    assert len(ew._CACHE) == 2
    ew.residual_add_forward(x2, y2.bfloat16())  # new dtypes
    ew.residual_add_forward(torch.randn(rows + 1, 512), torch.randn(rows + 1, 512))  # new size
    assert len(ew._CACHE) == 4
    keys = list(ew._CACHE)
    assert keys[0][:4] == (3, torch.float32, torch.float32, rows * 512) and keys[0][-1] == -1  # device: the CPU's


def test_cache_bypassed_under_tuning_and_dropped_with_new_plans(fake_launches: list,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    monkeypatch.setattr(ew, "TUNING", {"warps": 4, "stages": 4})
    ew.residual_add_forward(x, y)
    assert ew._CACHE == {} and fake_launches[0][-1].warps == 4
    monkeypatch.setattr(ew, "TUNING", {})
    ew.residual_add_forward(x, y)
    assert len(ew._CACHE) == 1
    monkeypatch.setattr(ew, "OP_PLANS", plan.parse_op_plans("residual_add=w8.s4.d1"))
    ew.residual_add_forward(x, y)  # replaced plans: the old decisions are forgotten
    assert len(ew._CACHE) == 1 and fake_launches[0][-1].stages == 4


def test_backward_packs_both_launches(fake_launches: list) -> None:
    h = 1024
    g, x, b = torch.randn(64, h), torch.randn(64, h), torch.randn(h)
    gx, gb = ew.bias_gelu_backward(g, x, b)
    main, red = fake_launches[-2], fake_launches[-1]
    assert main[3][:3] == (g.data_ptr(), x.data_ptr(), gx.data_ptr()) and main[3][3] == b.data_ptr()
    assert red[3][0] == main[3][4]  # the reduction reads the partials the main kernel wrote
    assert red[3][-1] == gb.data_ptr() and red[3][2] == h and red[1] == (32, 32)
    ew.bias_gelu_backward(torch.randn(64, h), torch.randn(64, h), b)
    assert len(ew._CACHE) == 1


def test_arg_pack_addresses() -> None:
    pack = launch.ArgPack("pqi", (5, -7, 3))
    assert pack.current() == (5, -7, 3)
    pack.values[0].value = 2**63 + 5  # pointers are unsigned 64-bit
    ptrs = ctypes.cast(pack.address, ctypes.POINTER(ctypes.c_void_p))
    assert ctypes.c_uint64.from_address(ptrs[0]).value == 2**63 + 5
    assert ctypes.c_int32.from_address(ptrs[2]).value == 3
    with pytest.raises(ValueError, match="unknown kernel launcher"):
        launch.resolve("nvrtc")


def test_launch_raw_packs_values_once_per_kernel_and_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_raw (RoPE, LayerNorm, compact AdamW, the counter data) goes through the pre-packed launcher: the
    values land, typed by their kinds, in one ArgPack per kernel, kinds and thread, on torch's current raw stream;
    a float32 (LayerNorm's eps) is a 4-byte float slot, a pointer above 2**63 stays unsigned."""
    import threading

    calls = []
    monkeypatch.setattr(launch, "launch", lambda k, grid, block, smem, stream, pack: calls.append(
        (k.handle, grid, block, smem, stream, pack, pack.current())))
    monkeypatch.setattr(launch, "raw_stream", lambda index: 1000 + index)
    monkeypatch.setattr(launch, "_raw_packs", {})
    raw = SimpleNamespace(kernel=SimpleNamespace(ptr=77))
    device = torch.device("cuda", 3)
    args = (2**63 + 8, -5, 7, 1e-5)
    ew.launch_raw(raw, 12, 256, "pqif", args, device)
    ew.launch_raw(raw, 13, 256, "pqif", (16, 6, 8, 0.5), device)
    (h0, g0, b0, s0, st0, p0, v0), (_, g1, _, _, _, p1, v1) = calls
    assert (h0, g0, b0, s0, st0) == (77, 12, (256, 1), 0, 1003) and g1 == 13
    assert p0 is p1 and p0.kinds == "pqif"
    assert v0[:3] == (2**63 + 8, -5, 7) and v0[3] == pytest.approx(1e-5, rel=1e-6)
    assert v1 == (16, 6, 8, 0.5)
    ew.launch_raw(raw, 1, 32, "pq", (9, 10), device)
    assert calls[-1][5] is not p0 and calls[-1][6] == (9, 10)  # other kinds: a pack of their own
    other = []
    thread = threading.Thread(target=lambda: other.append(ew.launch_raw(raw, 1, 32, "pqif", args, device)))
    thread.start()
    thread.join()
    assert calls[-1][5] is not p0  # another thread packs its own arguments


def _write(tmp_path: Path, tables: dict) -> Path:
    p = tmp_path / "card_plans.json"
    p.write_text(json.dumps(tables))
    return p


def test_card_table_lookup_and_rules(tmp_path: Path) -> None:
    mib = 1 << 20
    path = _write(tmp_path, {
        "NVIDIA H200": {"plans": "residual_add:bf16=w8.s4.d1",
                        "choice": {"residual_add:bf16": [[48 * mib, "torch"], [3 * mib, "peerline"]]},
                        "eager_torch_below": {"residual_add": 8 * mib}},
        "NVIDIA H100 80GB HBM3": {"choice": {"residual_add:bf16": [[3 * mib, "peerline"]]}}})
    h200, h100 = ct.table_for("NVIDIA H200", path), ct.table_for("NVIDIA H100 80GB HBM3", path)
    assert h200.device_winner("residual_add:bf16", 1) == "peerline"  # below every timed size: the smallest's
    assert h200.device_winner("residual_add:bf16", 47 * mib) == "peerline"
    assert h200.device_winner("residual_add:bf16", 48 * mib) == "torch"  # torch faster on this card from here
    assert h200.device_winner("residual_add:fp32", 1 << 40) == "peerline"  # never timed: the kernel
    assert h200.pick("residual_add", "bf16", 4 * mib, eager=True) == "torch"  # small and eager
    assert h200.pick("residual_add", "bf16", 4 * mib, eager=False) == "peerline"  # captured: device time only
    assert h100.pick("residual_add", "bf16", 48 * mib, eager=False) == "peerline"  # the other card, other verdict
    assert h100.eager_threshold("residual_add") == ct.DEFAULT_EAGER_TORCH_BELOW
    unknown = ct.table_for("NVIDIA A100-SXM4-80GB", path)
    assert unknown.plans == "" and unknown.pick("bias_gelu_fwd", "bf16", 1 << 30, eager=True) == "peerline"
    assert ct.table_for("NVIDIA H200", tmp_path / "missing.json").choice == {}


def test_card_table_write_keeps_other_cards(tmp_path: Path) -> None:
    path = _write(tmp_path, {"NVIDIA H100 80GB HBM3": {"plans": "residual_add=w8.s4"}})
    ct.write_entry("NVIDIA H200", {"plans": "", "choice": {"residual_add:fp32": [[1, "torch"]]}}, path)
    data = json.loads(path.read_text())
    assert set(data) == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    with pytest.raises(ValueError, match="winner"):
        ct.write_entry("NVIDIA H200", {"choice": {"residual_add:fp32": [[1, "triton"]]}}, path)
    assert json.loads(path.read_text()) == data  # a bad entry is never written


def test_plans_merge_card_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ew, "card_table", lambda index: ct.CardTable("NVIDIA H200", plans="residual_add:bf16=w8.s4.d1"))
    monkeypatch.setattr(ew, "_merged", {})
    merged = ew.op_plans(0)
    assert merged["residual_add:bf16"] == plan.parse_plan("w8.s4.d1")  # the card's plan over TUNED_PLANS
    assert merged["bias_gelu_bwd:bf16"] == plan.parse_op_plans(ew.TUNED_PLANS)["bias_gelu_bwd:bf16"]
    monkeypatch.setattr(ew, "_merged", {})
    monkeypatch.setattr(ew, "_USER_PLANS", "residual_add:bf16=w4.s2")
    assert ew.op_plans(0)["residual_add:bf16"] == plan.parse_plan("w4.s2")  # the environment wins
    assert ew.op_plans(None) is ew.OP_PLANS


def test_auto_choice_per_card_and_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    table = ct.CardTable.from_entry("NVIDIA H200", {"choice": {"residual_add:bf16": [[1 << 20, "peerline"],
                                                                                 [16 << 20, "torch"]]},
                                                    "eager_torch_below": {"residual_add": 1 << 20}})
    monkeypatch.setattr(ew, "card_table", lambda index: table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    bf16 = torch.bfloat16
    assert not ew._chosen(("a",), "residual_add", bf16, 1 << 10, 0, True, ("residual_add",))  # tiny eager: torch
    assert ew._chosen(("b",), "residual_add", bf16, 4 << 20, 0, True, ("residual_add",))
    assert not ew._chosen(("c",), "residual_add", bf16, 32 << 20, 0, False, ("residual_add",))  # torch faster
    assert ew._CHOICES == {("a",): False, ("b",): True, ("c",): False}


def test_eager_always_torch_needs_torch_at_every_size_and_an_endless_eager_threshold() -> None:
    """A dtype skips auto's size lookup in eager calls only where no launch of it, eager or captured, would run
    the kernel: the eager threshold at NEVER_EAGER and every timed size won by torch."""
    everywhere = {"residual_add:bf16": [[1 << 20, "torch"], [1 << 30, "torch"]],
                  "residual_add:fp32": [[1 << 20, "torch"], [1 << 30, "peerline"]]}
    table = ct.CardTable.from_entry("NVIDIA H200", {"choice": everywhere,
                                                    "eager_torch_below": {"residual_add": ct.NEVER_EAGER}})
    assert table.eager_always_torch("residual_add", "bf16")
    assert not table.eager_always_torch("residual_add", "fp32")  # a capture at 1 GiB runs the kernel
    finite = ct.CardTable.from_entry("NVIDIA H200", {"choice": everywhere,
                                                     "eager_torch_below": {"residual_add": 1 << 40}})
    assert not finite.eager_always_torch("residual_add", "bf16")  # a large eager launch runs the kernel
    untimed = ct.CardTable.from_entry("NVIDIA H200", {"eager_torch_below": {"residual_add": ct.NEVER_EAGER}})
    assert not untimed.eager_always_torch("residual_add", "bf16")  # no verdicts: the kernel by default


def test_auto_residual_add_eager_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager auto residual add of a dtype the card sends to torch everywhere returns torch's x + y after one
    cached lookup (kept in _CHOICES); a capture, or a dtype with a kernel verdict, takes the full path."""
    table = ct.CardTable.from_entry("NVIDIA H200", {
        "choice": {"residual_add:bf16": [[1, "torch"]], "residual_add:fp32": [[1, "peerline"]]},
        "eager_torch_below": {"residual_add": ct.NEVER_EAGER}})
    looked_up = []
    monkeypatch.setattr(ew, "card_table", lambda index: looked_up.append(index) or table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    monkeypatch.setattr(ew, "residual_add_reference", lambda x, y: ("torch", x, y))
    full_path = []
    monkeypatch.setattr(ew, "_supported", lambda *ts: full_path.append(ts) or False)

    def fake(dtype: torch.dtype) -> SimpleNamespace:  # the attributes the fast path reads of a CUDA tensor
        return SimpleNamespace(is_cuda=True, dtype=dtype, get_device=lambda: 2)

    x, y = fake(torch.bfloat16), fake(torch.bfloat16)
    monkeypatch.setattr(ew, "capturing", lambda: False)
    assert ew.auto_residual_add(x, y) == ("torch", x, y) and ew.auto_residual_add(x, y)[0] == "torch"
    assert looked_up == [2] and not full_path  # one table lookup for both calls, no size checks
    assert ew._CHOICES == {("residual_add", "eager always torch", torch.bfloat16, 2): True}
    ew.auto_residual_add(fake(torch.float32), y)
    assert len(full_path) == 1  # fp32 has a kernel verdict: the full path
    monkeypatch.setattr(ew, "capturing", lambda: True)
    ew.auto_residual_add(x, y)
    assert len(full_path) == 2  # captured: the full path, whatever the eager rule


def test_tuner_rules() -> None:
    from peerline.bench.kernel_tools import tune

    assert tune.eager_threshold(-1.0, [(1, 0.0)]) == 0  # no extra host time: the kernel from the first byte
    assert tune.eager_threshold(5.0, [(1 << 20, 1.0), (16 << 20, 6.0)]) == 16 << 20
    assert tune.eager_threshold(8.0, [(1 << 20, 1.0), (4 << 20, 4.0)]) == 8 << 20  # extrapolated
    assert tune.eager_threshold(8.0, [(1 << 20, -1.0)]) == 1 << 62  # torch is faster: never
    rows = [{"case": "residual_add bf16+bf16 16 MiB", "plan": "A", "status": "ok", "vs_torch": 0.97,
             "bytes": 48 << 20, "l2_bytes": 0},
            {"case": "residual_add bf16+bf16 1 MiB", "plan": "A", "status": "ok", "vs_torch": 1.2,
             "bytes": 3 << 20, "l2_bytes": 0}]
    assert tune.verdicts(rows, {"residual_add:bf16": ("A", 1.0)}) == {
        "residual_add:bf16": [[3 << 20, "peerline"], [48 << 20, "torch"]]}


def test_residual_add_runs_the_one_pass_kernel_unless_the_engine_is_asked_for(
        fake_launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """pl_flat covers the aligned body with one chunk per thread (256 per block, no shared memory); TUNING's
    "engine" key sends the same call through pl_main's warp-specialized launch."""
    def get_op(spec: kc.KernelSpec, dev: int) -> kc.CompiledOp:
        fake_launches[0].append(spec)
        op = _fake_op(spec, dev)
        op.flat = SimpleNamespace(kernel=SimpleNamespace(ptr=2000))
        return op

    monkeypatch.setattr(kc, "get_op", get_op)
    rows, width = random.randint(3, 40), random.choice([512, 768, 1536])
    for xt, yt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        x, y = torch.randn(rows, width).to(xt), torch.randn(rows, width).to(yt)
        out = ew.residual_add_forward(x, y)
        grid, block, smem, vals = fake_launches[-1]
        e = 16 // min(xt.itemsize, yt.itemsize)
        head, nchunks = vals[4], vals[5]
        assert head == 0 and nchunks == x.numel() // e  # aligned allocations: no scalar head
        assert block == (ew.FLAT_THREADS, 1) and smem == 0 and grid == -(-nchunks // ew.FLAT_THREADS)
        assert vals[:4] == (x.data_ptr(), y.data_ptr(), out.data_ptr(), x.numel())
    monkeypatch.setattr(ew, "TUNING", {"warps": 4, "stages": 2, "engine": 1})
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    ew.residual_add_forward(x, y)
    grid, block, smem, vals = fake_launches[-1]
    spec = fake_launches[0][-1]
    assert spec.warps == 4 and block == (spec.threads, 1) and smem == spec.smem_bytes > 0


def test_sweep_puts_the_residual_add_on_the_engine_and_the_tuner_times_pl_flat_once() -> None:
    """The launch-plan sweep explores the engine, so its residual-add rows ask for it (engine=1); the tuner times the
    path a run takes, and the residual add's (pl_flat) ignores plans: one candidate."""
    from peerline.bench.kernel_tools import sweep, tune

    p = plan.parse_plan("w4.s4.t128.d1")
    assert sweep.engine_tuning(p, "res") == {**p.tuning(), "engine": 1}
    assert "engine" not in sweep.engine_tuning(p, "fwd") and "engine" not in sweep.engine_tuning(p, "bwd")
    assert tune.candidates("res", "residual_add", torch.bfloat16, 0, 3) == [plan.LaunchPlan()]
