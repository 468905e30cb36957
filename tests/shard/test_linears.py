"""The linear kernels (shard/linears.py) on a shard's Runner in-process (a small random Llama): bf16 on its packed
weights gives exactly F.linear's numbers; fp32 takes, per row count, the way timed fastest, each equal to F.linear
to rounding, and holds its weight only in the layouts its plan reads; --quantize int8 and int4 really hold their
weights quantized (in bf16 and fp32 models), the logits stay close to the unquantized model's, and a request's
greedy tokens do not depend on what shares its batch."""
import pytest
import torch
from torch import nn

from shard import linears
from shard import model as model_lib
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

from serve import greedy

BS = 4


def runner(path, quantize=None, dtype="bfloat16") -> Runner:
    loaded = model_lib.load(str(path), dtype, torch.device("cpu"), 0, 1, quantize)
    r = Runner(loaded, torch.device("cpu"), BS, 0, 1)
    r.allocate(256)
    return r


def test_packed_bf16_equals_f_linear_bit_for_bit():
    torch.manual_seed(0)
    for out_features, in_features in ((96, 128), (128, 96), (512, 128)):
        plain = nn.Linear(in_features, out_features, bias=True, dtype=torch.bfloat16)
        packed = linears.kernel_for(plain, None, torch.device("cpu"), head=False)
        if not linears.packs_bf16():  # a CPU oneDNN cannot pack bf16 for keeps F.linear
            assert packed is None
            continue
        assert isinstance(packed, linears.Packed)
        for rows in (1, 3, 8, 17, 64, 300):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            assert torch.equal(packed(x), plain(x)), (out_features, in_features, rows)


def test_tuned_fp32_ways_equal_f_linear_and_the_timings_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CB_CACHE", str(tmp_path))
    monkeypatch.setattr(linears, "_plans", {})
    torch.manual_seed(0)
    plain = nn.Linear(128, 384, bias=True)
    tuned = linears.kernel_for(plain, None, torch.device("cpu"), head=False)
    assert isinstance(tuned, linears.Tuned) and set(tuned.plan.ways) == set(linears.PROBES)
    measured = dict(tuned.plan.ways)
    tuned.weight, tuned.packed, tuned.onednn = linears._layouts(plain.weight.detach(), {"tile", "onednn"})
    for way in ("linear", "transposed", "tile", "onednn"):
        tuned.plan = linears.Plan({n: way for n in linears.PROBES})
        for rows in (0, 1, 5, 16, 33, 64):  # 0: a prompt chunk whose rows' logits are all dropped
            x = torch.randn(rows, 128)
            torch.testing.assert_close(tuned(x), plain(x), rtol=1e-5, atol=1e-5)
    plan = linears.Plan({n: "tile" if n == 64 else "transposed" for n in linears.PROBES})
    assert plan.way(49) == plan.way(64) == "tile" and plan.way(48) == "transposed"
    plan = linears.Plan({n: "onednn" if n == linears.PROBES[-1] else "linear" for n in linears.PROBES})
    assert plan.way(linears.PROBES[-1] + 1000) == "onednn", "beyond the probes: the last one's way"
    monkeypatch.setattr(linears, "_plans", {})  # a new process: the plan comes from disk, nothing is timed
    monkeypatch.setattr(linears.Plan, "measure", classmethod(lambda cls, o, i: pytest.fail("timed twice")))
    assert linears.plan_for(384, 128).ways == measured


def test_tuned_holds_only_the_layouts_its_plan_reads():
    torch.manual_seed(0)
    plain = nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 64)
    for ways, held in ((("onednn",), ("onednn",)), (("linear", "tile"), ("weight", "packed")),
                       (("transposed", "onednn"), ("weight", "onednn"))):
        plan = linears.Plan({n: ways[i % len(ways)] for i, n in enumerate(linears.PROBES)})
        tuned = linears.Tuned(plain, plan)
        assert {name for name in ("weight", "packed", "onednn") if getattr(tuned, name) is not None} == set(held)
        torch.testing.assert_close(tuned(x), plain(x), rtol=1e-5, atol=1e-5)


def test_a_plan_reads_a_second_layout_only_where_it_saves_ten_percent():
    def timed(onednn_times, linear_times):
        return {n: {"onednn": o, "linear": l, "transposed": 2 * l} for n, o, l in
                zip(linears.PROBES, onednn_times, linear_times)}
    half = len(linears.PROBES) // 2
    ones = [1.0] * len(linears.PROBES)
    # oneDNN 5% slower at one row count, 2x faster at the rest: oneDNN alone
    plan = linears._choose(timed(ones, [0.95] + [2.0] * (len(ones) - 1)))
    assert set(plan.values()) == {"onednn"}
    # MKL 2x faster everywhere: the plain layout alone (transposed never beats linear here)
    assert set(linears._choose(timed(ones, [0.5] * len(ones))).values()) == {"linear"}
    # each 2x faster at half of the row counts: both layouts, each where it wins
    plan = linears._choose(timed(ones, [0.5] * half + [2.0] * (len(ones) - half)))
    assert [plan[n] for n in linears.PROBES] == ["linear"] * half + ["onednn"] * (len(ones) - half)


def test_weights_wider_than_the_timed_rows_share_one_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("CB_CACHE", str(tmp_path))
    monkeypatch.setattr(linears, "_plans", {})
    monkeypatch.setattr(linears, "MEASURED_OUT", 256)
    timed = []
    real = linears.Plan.measure.__func__
    monkeypatch.setattr(linears.Plan, "measure", classmethod(lambda cls, o, i: timed.append(o) or real(cls, o, i)))
    assert linears.plan_for(512, 64) is linears.plan_for(4096, 64)
    assert timed == [512] and linears.plan_for(128, 64) is not linears.plan_for(512, 64)


def test_fp32_model_linears_are_tuned(tiny_llama):
    loaded = model_lib.load(str(tiny_llama), "float32", torch.device("cpu"), 0, 1)
    assert sum(isinstance(m, linears.Tuned) for m in loaded.model.modules()) == 3 * 4 + 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode, kind, bits", [("int8", linears.Int8, torch.int8), ("int4", linears.Int4, torch.uint8)])
def test_quantized_weights_logits_close_and_batch_invariant(tiny_llama, mode, kind, bits, dtype):
    plain, quant = runner(tiny_llama, dtype=dtype), runner(tiny_llama, mode, dtype)
    per_layer = 4  # the lean forward's q/k/v, output, gate/up and down projections (lean.py)
    fast = linears.Packed if dtype == "bfloat16" else linears.Tuned
    packed = sum(isinstance(m, fast) for m in plain.loaded.model.modules())
    assert packed == (3 * per_layer + 1 if dtype == "float32" or linears.packs_bf16() else 0)
    layers = [m for m in quant.loaded.model.modules() if isinstance(m, (linears.Int8, linears.Int4))]
    assert all(m.compute == torch.bfloat16 for m in layers), "fp32 activations enter the quantized GEMMs in bf16"
    layers = [m for m in layers if isinstance(m, kind)]
    assert len(layers) == 3 * per_layer + (mode == "int8") and all(m.weight.dtype == bits for m in layers)
    assert isinstance(quant.loaded.model.lm_head, linears.Int8), "int4 keeps the LM head at 8 bits"
    prompt = list(range(10, 40))
    scored = [torch.tensor(r.step([Entry(9, prompt, list(range(8)), params=Params(), prompt_tokens=len(prompt),
                                         prefill_logprobs=True)]).prefill[0][1][1:]) for r in (plain, quant)]
    drift = (scored[0] - scored[1]).abs()  # 4 bits on random weights (no outliers to spare) move more than 8
    # (int8's mean: 0.030 in bf16 on a CPU without AVX-512, whose unquantized bf16 path rounds otherwise)
    assert drift.max() < (0.1 if mode == "int8" else 1.5) and drift.mean() < (0.04 if mode == "int8" else 0.4)
    plain.clear()
    quant.clear()
    gen = torch.Generator().manual_seed(3)
    others = {rid: torch.randint(5, 500, (11 + rid,), generator=gen).tolist() for rid in range(2, 6)}
    alone = greedy(quant, {1: prompt}, 12)[1]
    quant.clear()
    together = greedy(quant, {1: prompt, **others}, 12)[1]
    assert alone == together


def test_int4_dequantizes_to_within_half_a_step():
    torch.manual_seed(1)
    plain = nn.Linear(64, 48, bias=False)
    quant = linears.Int4(plain)
    eye = torch.eye(64)
    w = plain.weight.detach()
    step = (w.view(48, 2, 32).amax(-1) - w.view(48, 2, 32).amin(-1)) / 15
    err = (quant(eye).t() - w).abs().view(48, 2, 32)
    bf16 = 2 ** -6 * w.abs().max()  # an fp32 model's quantized GEMM runs in bf16: scales, zeros and output rounded
    assert (err <= step[..., None] / 2 + bf16).all()
    assert not (err <= step[..., None] / 4).all(), "the error is the quantization's, not only bf16's"


def test_int4_refused_off_cpu():
    with pytest.raises(ValueError, match="CPU kernel only"):
        linears.check("int4", torch.device("cuda"))
