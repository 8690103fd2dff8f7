"""Launch plans of the warp-specialized kernels (plan.LaunchPlan, KernelSpec's shape fields, grid caps) and the
sweep's command line, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peerline.kernels import compile as kc
from peerline.kernels import elementwise as ew
from peerline.kernels import plan

pytestmark = pytest.mark.timeout(60)


def test_default_plan_is_todays_design() -> None:
    p = plan.LaunchPlan()
    assert p.label() == "w8.s2.t0.b0.d0.v1"
    spec = kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", **p.spec_fields())
    assert spec == kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16")


@pytest.mark.parametrize("label", ["w8.s2.t0.b0.d0.v1", "w4.s4.t512.b2.d1.v2", "w8.s3.t1024.b0.d1.v1"])
def test_label_round_trip(label: str) -> None:
    assert plan.parse_plan(label).label() == label


def test_parse_partial_and_bad_labels() -> None:
    assert plan.parse_plan("s3.d1") == plan.LaunchPlan(stages=3, direct_store=True)
    for bad in ("w8.x3", "s", "w0", "v3", "w8.t100", "b-1"):
        with pytest.raises(ValueError):
            plan.parse_plan(bad)


def test_spec_shape_fields() -> None:
    base = dict(op=kc.OP_RESIDUAL_ADD, x="bfloat16", y="bfloat16", out="bfloat16")
    d = kc.KernelSpec(**base, direct=1, stages=4)
    assert d.smem_bytes == 4 * 512 * 8 * 4  # [A | B] only: no C buffers with direct stores
    v = kc.KernelSpec(**base, vec=2)
    assert (v.e, v.tile_chunks, v.smem_bytes) == (16, 256, 2 * 256 * 16 * 6)  # same stage bytes as vec 1
    t = kc.KernelSpec(**base, tile=1024, warps=4)
    assert t.tile_chunks == 1024
    defs = kc.KernelSpec(**base, direct=1, vec=2).defines()
    assert "-DPL_DIRECT_STORE=1" in defs and "-DPL_VEC=2" in defs
    with pytest.raises(ValueError, match="shared memory"):
        kc.KernelSpec(**base, tile=2048, stages=8)
    with pytest.raises(ValueError, match="multiple of 32 x warps"):
        kc.KernelSpec(**base, tile=300)
    assert kc.KernelSpec(**base, warps=6).tile_chunks == 384  # the default rule rounds to whole compute threads


def test_grid_caps() -> None:
    assert plan.plan_grid_cap(132, 4, 0) == 528
    assert plan.plan_grid_cap(132, 4, 2) == 264
    assert plan.plan_grid_cap(132, 1, 3) == 132  # never more than fit
    op = kc.CompiledOp(kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32"), 0, None, None, None, 132, 4, {})
    try:
        ew.TUNING.update({"blocks_per_sm": 2, "stages": 3})
        assert ew._max_grid(op) == 264
        assert ew._spec(kc.OP_BIAS_GELU_FWD, "float32", bias="float32").stages == 3  # grid keys are not spec fields
        ew.TUNING["grid_cap"] = 2
        assert ew._max_grid(op) == 2
    finally:
        ew.TUNING.clear()


def test_every_sweep_plan_builds_a_spec_for_every_case() -> None:
    from peerline.bench.kernel_tools import sweep as ks
    plans = [(plan.parse_plan(label), kinds) for label, kinds in map(ks.parse_sweep_plan, ks.SWEEP_PLANS)]
    assert plans[0][0] == plan.LaunchPlan()  # the default is timed first (the budget never cuts it)
    assert len({p for p, _ in plans}) == len(plans)  # no plan twice
    specs = ks._specs_for(plans, ks.SWEEP_CASES)
    want = set()
    for p, kinds in plans:  # every shape fits every op it is meant for (shared memory, tile rule)
        shape = tuple(p.spec_fields().values())
        want |= {(shape, c[1], c[2]) for c in ks.SWEEP_CASES if c[1] in kinds}
    assert len(specs) == len(want)


def test_sweep_command_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from peerline.bench.suites import kernels as suite

    assert suite.main(["--sweep", "--sweep-plans", "w8.q3"]) == 2
    assert "bad plan field" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert suite.main(["--sweep"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_sweep_summary_picks_the_fastest_correct_plan(tmp_path) -> None:
    import json

    from peerline.bench.kernel_tools import sweep as ks
    rows = [{"case": "c 256 MiB", "plan": "w8.s2.t0.b0.d0.v1", "status": "ok", "GBps": 3900.0, "vs_torch": 0.91,
             "vs_copy": 0.9, "torch_GBps": 4286.0, "copy_GBps": 4333.0},
            {"case": "c 256 MiB", "plan": "w8.s2.t0.b0.d1.v1", "status": "ok", "GBps": 4200.0, "vs_torch": 0.98,
             "vs_copy": 0.97, "torch_GBps": 4286.0, "copy_GBps": 4333.0},
            {"case": "c 256 MiB", "plan": "w8.s4.t0.b0.d1.v1", "status": "wrong", "error": "rel err 1"}]
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (line,) = ks.summarize(path)
    assert line.startswith("SWEEP BEST c 256 MiB: w8.s2.t0.b0.d1.v1 4200 GB/s = 0.98x torch")
    assert "default 3900 GB/s" in line and "2 plans timed, 1 wrong" in line


def test_per_op_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = plan.parse_op_plans("residual_add=w8.s4.d1, bias_gelu_bwd:fp32=w4.s4.d1.b2")
    assert plan.op_plan(plans, "residual_add", "bf16") == plan.LaunchPlan(stages=4, direct_store=True)
    assert plan.op_plan(plans, "bias_gelu_bwd", "fp32").blocks_per_sm == 2
    assert plan.op_plan(plans, "bias_gelu_bwd", "bf16") is None
    assert plan.parse_op_plans("") == {}
    for bad in ("residual_add", "gelu=w8", "residual_add:fp16=w8", "residual_add=w8.z1"):
        with pytest.raises(ValueError):
            plan.parse_op_plans(bad)
    monkeypatch.setattr(ew, "OP_PLANS", plans)
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16").direct == 1
    assert ew._spec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32").direct == 0  # no plan: the default
    op = kc.CompiledOp(kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32"), 0, None, None, None, 132, 4, {})
    assert ew._max_grid(op) == 264  # the plan's blocks_per_sm
    monkeypatch.setattr(ew, "TUNING", {"stages": 3})  # experiments win over the per-op plans
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16").direct == 0


def test_bulk_loader_plan_and_spec() -> None:
    """loader=1 (cp.async.bulk) is a plan field (.l1 in labels, absent at 0 so old labels stay), a KernelSpec field
    and a macro; the SASS check asks UBLKCP of it and LDGSTS (no UBLKCP) of the cp.async loader."""
    from peerline.bench.kernel_tools import inspect_sass
    p = plan.parse_plan("w8.s4.d1.l1")
    assert p.loader == 1 and p.label() == "w8.s4.t0.b0.d1.v1.l1" and plan.parse_plan(p.label()) == p
    assert plan.LaunchPlan().label() == "w8.s2.t0.b0.d0.v1"
    with pytest.raises(ValueError, match="loader"):
        plan.LaunchPlan(loader=2)
    spec = kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16",
                         **p.spec_fields())
    assert "-DPL_LOADER=1" in spec.defines() and spec.label().endswith(".l1")
    assert inspect_sass.loader_copies_present({"LDGSTS": 0, "UBLKCP": 2}, 1)
    assert not inspect_sass.loader_copies_present({"LDGSTS": 14, "UBLKCP": 0}, 1)
    assert inspect_sass.loader_copies_present({"LDGSTS": 14, "UBLKCP": 0}, 0)
    assert not inspect_sass.loader_copies_present({"LDGSTS": 14, "UBLKCP": 2}, 0)
    # the bulk storer (TMA stores from the storer warp): UBLKCP.G.S exactly when asked for
    assert inspect_sass.loader_copies_present({"UBLKCP": 2, "UBLKCP.G.S": 1}, 1, 1)
    assert not inspect_sass.loader_copies_present({"UBLKCP": 2, "UBLKCP.G.S": 0}, 1, 1)
    assert not inspect_sass.loader_copies_present({"LDGSTS": 14, "UBLKCP.G.S": 1}, 0, 0)
    q = plan.parse_plan("w8.s4.l1.o1")
    assert q.storer == 1 and q.label() == "w8.s4.t0.b0.d0.v1.l1.o1" and plan.parse_plan(q.label()) == q
    with pytest.raises(ValueError, match="direct_store"):
        plan.parse_plan("w8.s4.d1.o1")
    assert "-DPL_STORER=1" in kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", storer=1).defines()


def test_cache_hint_field() -> None:
    from peerline.kernels import compile as kc
    from peerline.kernels.plan import LaunchPlan, parse_plan

    p = parse_plan("w4.s4.t256.d1.l1.h2")
    assert (p.hint, p.loader, p.direct_store) == (2, 1, True) and p.label() == "w4.s4.t256.b0.d1.v1.l1.h2"
    assert parse_plan("w8.s2").label() == "w8.s2.t0.b0.d0.v1"  # no hint: labels of earlier runs unchanged
    assert "-DPL_HINT=2" in kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16",
                                          **p.spec_fields()).defines()
    with pytest.raises(ValueError, match="needs direct_store"):
        LaunchPlan(hint=1)
    with pytest.raises(ValueError, match="needs loader 1"):
        LaunchPlan(hint=2, direct_store=True)
    with pytest.raises(ValueError, match="hint must be"):
        LaunchPlan(hint=3, direct_store=True)


def test_rounds_field() -> None:
    """rounds (.r) is a grid field: in labels only where not 0, not a KernelSpec field (same build), exclusive with
    blocks_per_sm."""
    p = plan.parse_plan("w4.s4.t256.d1.l1.h1.r8")
    assert p.rounds == 8 and p.label() == "w4.s4.t256.b0.d1.v1.l1.h1.r8" and plan.parse_plan(p.label()) == p
    assert "rounds" not in p.spec_fields() and "blocks_per_sm" not in p.spec_fields()
    assert p.tuning()["rounds"] == 8
    base = dict(op=kc.OP_RESIDUAL_ADD, x="bfloat16", y="bfloat16", out="bfloat16")
    q = plan.parse_plan("w4.s4.t256.d1.l1.h1")
    assert kc.KernelSpec(**base, **p.spec_fields()) == kc.KernelSpec(**base, **q.spec_fields())  # one cubin
    assert plan.LaunchPlan().label() == "w8.s2.t0.b0.d0.v1"  # earlier labels unchanged
    with pytest.raises(ValueError, match="exclude each other"):
        plan.parse_plan("w8.s4.b2.r8")
    with pytest.raises(ValueError, match="rounds must be"):
        plan.LaunchPlan(rounds=-1)


def test_vector_grid_rounds() -> None:
    # persistent: never more blocks than resident, never more than tiles
    assert plan.vector_grid(10_000, 792) == 792
    assert plan.vector_grid(100, 792) == 100
    # rounds: at most r tiles per block once that grid is MIN_WAVES (4) waves of resident blocks deep
    assert plan.MIN_WAVES == 4
    assert plan.vector_grid(65_536, 792, 8) == 8192
    assert plan.vector_grid(4 * 792 * 8, 792, 8) == 4 * 792  # exactly 4 waves
    # shallower: the persistent grid (a partial second or third wave would idle most SMs at the end)
    assert plan.vector_grid(4 * 792 * 8 - 8, 792, 8) == 792
    assert plan.vector_grid(4096, 792, 8) == 792
    assert plan.vector_grid(4097, 792, 4) == 792
    assert plan.vector_grid(7, 2, 1) == 2
    assert plan.vector_grid(8, 2, 1) == 8
    for ntiles in (1, 2, 5, 791, 792, 793, 4096, 65_537, 1 << 20):
        for r in (1, 2, 3, 8, 32):
            g = plan.vector_grid(ntiles, 792, r)
            assert min(792, ntiles) <= g <= ntiles
            if g > 792:  # beyond the resident grid: deep enough, and every block walks at most r tiles
                assert g >= plan.MIN_WAVES * 792 and -(-ntiles // g) <= r
            else:
                assert g == min(792, ntiles)
    vp = plan.plan_vector(1 << 27, 0, 8, 256, 792, rounds=16)
    assert vp is not None and vp.ntiles == 65_536 and vp.grid == 4096


def test_rounds_reach_the_forward_and_residual_grids_not_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch-grid plumbing of ew: rounds from TUNING or a per-op plan; grid_cap caps only the resident part."""
    op = kc.CompiledOp(kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16"), 0, None, None,
                       None, 132, 6, {})
    monkeypatch.setattr(ew, "TUNING", plan.parse_plan("w8.s4.d1.r8").tuning())
    assert (ew._max_grid(op), ew._rounds(op)) == (792, 8)
    monkeypatch.setattr(ew, "TUNING", {**plan.parse_plan("w8.s4.d1.r2").tuning(), "grid_cap": 2})
    assert (ew._max_grid(op), ew._rounds(op)) == (2, 2)
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16").stages == 4
    monkeypatch.setattr(ew, "TUNING", {})
    monkeypatch.setattr(ew, "OP_PLANS", plan.parse_op_plans("residual_add=w4.s4.t256.d1.l1.h1.r16"))
    assert ew._rounds(op) == 16
    src = Path(ew.__file__).read_text()
    bwd = src[src.index("def bias_gelu_backward"):src.index("def residual_add_forward")]
    assert "_rounds(" not in bwd  # the backward's grid stays persistent (bias partials scale with the grid)
    assert src.count("_rounds(op, l2)") == 2  # forward and residual add


def test_phi_field() -> None:
    """phi (.p1): the forward's bf16 results through phi_cdf_lite = KernelSpec gelu GELU_LITE; absent at 0 (the
    build's PL_GELU stays, so PEERLINE_KERNEL_GELU and the bench's normcdff variant are untouched)."""
    assert plan.GELU_LITE == kc.GELU_LITE
    p = plan.parse_plan("w16.s3.t1024.d1.l1.r8.p1")
    assert p.phi == 1 and p.label() == "w16.s3.t1024.b0.d1.v1.l1.r8.p1" and plan.parse_plan(p.label()) == p
    assert p.spec_fields()["gelu"] == kc.GELU_LITE and "gelu" not in plan.LaunchPlan().tuning()
    spec = kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", **p.spec_fields())
    assert "-DPL_GELU=4" in spec.defines() and spec.label().endswith(".p1")
    assert spec.launch_plan() == plan.parse_plan("w16.s3.t1024.d1.l1.p1")  # rounds is no spec field
    with pytest.raises(ValueError, match="phi must be"):
        plan.LaunchPlan(phi=2)


def test_l2_size_class_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """OP[:DTYPE]:l2 plans apply to launches whose bytes fit in L2 (plan.in_l2), ahead of the size-free plans; the
    others never see them; TUNING (experiments) still wins over both."""
    plans = plan.parse_op_plans("residual_add:bf16=w4.s4.t256.d1.l1.h1.r1,residual_add:bf16:l2=w8.s2.t256.d1.l1.h2,"
                                "residual_add:l2=w4.s2.d1")
    assert set(plans) == {"residual_add:bf16", "residual_add:bf16:l2", "residual_add:l2"}
    assert plan.op_plan(plans, "residual_add", "bf16", l2=True).hint == 2
    assert plan.op_plan(plans, "residual_add", "bf16").hint == 1
    assert plan.op_plan(plans, "residual_add", "fp32", l2=True).warps == 4  # OP:l2 when no OP:DTYPE:l2
    assert plan.op_plan(plans, "residual_add", "fp32") is None
    for bad in ("residual_add:bf16:l3=w8", "residual_add:l2:bf16=w8", "residual_add:bf16:fp32=w8"):
        with pytest.raises(ValueError, match="OP\\[:DTYPE\\]\\[:l2\\]"):
            plan.parse_op_plans(bad)
    mib = 1 << 20
    assert plan.in_l2(48 * mib, 50 * mib) and plan.in_l2(75 * mib, 50 * mib) and not plan.in_l2(76 * mib, 50 * mib)
    assert not plan.in_l2(1, 0)  # no L2 size known: no size class
    monkeypatch.setattr(ew, "OP_PLANS", plans)
    res = {"y": "bfloat16", "out": "bfloat16"}
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", l2=True, **res).hint == 2
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", **res).hint == 1
    op = kc.CompiledOp(kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", **res), 0, None, None, None, 132, 6, {})
    assert (ew._rounds(op), ew._rounds(op, l2=True)) == (1, 0)
    monkeypatch.setattr(ew, "TUNING", {"stages": 3})
    assert ew._spec(kc.OP_RESIDUAL_ADD, "bfloat16", l2=True, **res).hint == 0
