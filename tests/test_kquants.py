"""A GGUF's k-quant blocks read as they are (``uag.runtime.kquants``) and ``exact.c``'s
factored block parameters (``NativeLinear.factor``): the file's weights bitwise, the same
product bits as the plain parameters on every path and row count, refused where they differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from uag.kernels import native
from uag.kernels.formats import exact_parameters, factor_parameters
from uag.runtime import kquants

gguf = pytest.importorskip("gguf")

needs_native = pytest.mark.skipif(
    native.native_unavailable() is not None, reason=f"native kernel: {native.native_unavailable()}"
)
N, K = 48, 512  # 3 groups of 16 outputs, 2 super-blocks of 256 inputs


def _blocks(kind: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random super-blocks of ``kind`` (every byte pattern is a block) with finite fp16 scales
    near a trained model's; Q6_K's int8 scales include -128 (llama.cpp's quantiser reaches it)."""
    rng = np.random.default_rng(seed)
    count = rows * cols // kquants.SUPER
    raw = rng.integers(0, 256, size=(count, kquants.BLOCK_BYTES[kind]), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-3, size=(count, 2)).astype(np.float16).view(np.uint8)
    if kind == kquants.Q4_K:
        raw[:, 0:4] = d  # d and dmin
    else:
        raw[:, 208:210] = d[:, :2]
        raw[0, 192] = np.uint8(128)  # int8 scale -128
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF holding one Q4_K and one Q6_K matrix of ``N`` x ``K``."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    for name, kind, seed in (("blk.0.ffn_up.weight", kquants.Q4_K, 1),
                             ("blk.0.ffn_down.weight", kquants.Q6_K, 2)):  # fmt: skip
        writer.add_tensor(
            name, _blocks(kind, N, K, seed), raw_dtype=gguf.GGMLQuantizationType(kind)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _source(path: Path, name: str) -> kquants.KQuant:
    arch, entries = kquants.read_directory(path)
    assert arch == "qwen2"
    return kquants.KQuant(path, entries[name])


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight"])
def test_kquant_blocks_read_back_gguf_own_weights(kquant_file, name):
    """The directory read here finds each tensor where ``gguf.GGUFReader`` does, and the
    decoded integers and parameters give ``gguf``'s own de-quantised weights, bitwise."""
    source = _source(kquant_file, name)
    tensor = next(t for t in gguf.GGUFReader(kquant_file).tensors if t.name == name)
    assert source.entry.offset == tensor.data_offset and source.entry.kind == int(
        tensor.tensor_type
    )
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(N, K)
    assert torch.equal(source.weight(), torch.from_numpy(np.ascontiguousarray(expected)))
    q, scale, base, block = source.decode()
    lo, hi = (0, 15) if source.entry.kind == kquants.Q4_K else (-32, 31)
    assert q.dtype == torch.int8 and lo <= int(q.min()) and int(q.max()) <= hi
    assert scale.shape == (N, K // block) and (base is None) == (source.entry.kind == kquants.Q6_K)


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@needs_native
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight"])
def test_factored_parameters_give_the_same_bits_on_every_path_and_row_count(
    kquant_file, name, packed, monkeypatch
):
    """A linear de-quantised from a k-quant keeps the file's blocks (checked equal to its
    weight), which factor into an fp32 unit per 256 inputs times int8 multipliers: fewer bytes
    and, multiplied back in the kernel, bitwise the plain parameters' products, for 1-9 rows
    on the scalar reference, AVX-512 VNNI and AMX where each runs; packed at the file's own
    bits too (Q4_K's integers at 4, unpacked in registers on VNNI; Q6_K's at 6)."""
    source = _source(kquant_file, name)
    linear = _linear(source.weight())
    linear.uag_kquant = source
    layer = native.NativeLinear(linear)
    assert layer.kquant is source
    if not layer.to_integer(anywhere=True):
        pytest.skip("exact.c's layout does not hold this weight here")
    assert torch.equal(layer.dequantized(), linear.weight.detach())
    assert layer.x8_affine == (source.entry.kind == kquants.Q4_K)
    plain = exact_parameters(layer).clone()
    plain_bytes = layer.block_scales.nbytes
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(3))
    x[1, 5] = 300.0  # an outlier channel
    lib = layer.lib
    paths = ((0, 0), (0, 1), (1, 1))
    try:
        expected = {}
        for amx, vnni in paths:
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            expected[amx, vnni] = [layer(x[:m]) for m in range(1, 10)]
        if packed:
            monkeypatch.setenv("UAG_PACKED_BODY", "1")
            assert layer.pack() and layer.x8_bits == (4 if layer.x8_affine else 6)
        assert layer.factor() and layer.x8_span == 256
        assert layer.block_scales.nbytes < plain_bytes / 2
        assert torch.equal(exact_parameters(layer), plain)
        for amx, vnni in paths:
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            for m in range(1, 10):
                assert torch.equal(layer(x[:m]), expected[amx, vnni][m - 1]), (amx, vnni, m)
                assert torch.equal(layer(x[:m]), expected[0, 0][m - 1])  # every path alike
    finally:
        lib.uag_set_amx(1)
        lib.uag_set_avx512vnni(1)


@needs_native
def test_a_kquant_that_is_not_the_weight_is_not_used(kquant_file):
    """One weight off by one fp32 step: the file's blocks are not this weight's, so the layer
    keeps the form found from its values."""
    source = _source(kquant_file, "blk.0.ffn_up.weight")
    weight = source.weight()
    weight[7, 100] = torch.nextafter(weight[7, 100], torch.tensor(1.0))
    linear = _linear(weight)
    linear.uag_kquant = source
    assert native.NativeLinear(linear).kquant is None


def test_factor_parameters_refuse_what_has_no_exact_factoring():
    """Parameters that are an fp32 unit times int8 multipliers factor, into the same floats
    (a multiplier of -128 included); random floats, or multipliers past int8, do not."""
    gen = torch.Generator().manual_seed(4)
    unit = (torch.rand(2, 2, 1, 16, generator=gen) * 1e-3).half().float()  # an fp16 each
    mult = torch.randint(-128, 128, (2, 2, 8, 1, 16), generator=gen).float()
    mult[0, 0, 3, 0, 5] = -128
    values = (unit[:, :, None] * mult).reshape(2, 16, 1, 16)  # [groups, K/32, kinds, 16]
    factored = factor_parameters(values, 32)
    assert factored is not None
    layer = type("L", (), {"block_scales": factored, "x8_affine": False, "x8_span": 256,
                           "x8_block": 32})()  # fmt: skip
    assert torch.equal(exact_parameters(layer), values)
    assert factor_parameters(torch.rand(2, 16, 1, 16, generator=gen), 32) is None
    assert factor_parameters(values * torch.tensor([1.0] * 15 + [1.001]), 32) is None
    assert factor_parameters(values[:, :12], 32) is None  # not a whole number of spans
