"""qrt's CPU kernel for codes of 4, 5 and 6 bits with two levels of scales (kernels/superblock_cpu.py,
csrc/superblock_cpu.cpp), which runs llama.cpp's block types at their own width: the neutral form's
dequantization against gguf-py's dequantizer bit for bit, both of the kernel's routes against it on
every block type, rows that do not depend on their batch, the rows an embedding gathers, the bytes
a weight takes, and GGUF files of every kept type (mixed in one fused layer as llama.cpp's mixes
store them) run on it, eagerly and compiled."""

import gguf
import numpy as np
import pytest
import torch
from helpers.checkpoints.format_cases.gguf import K_QUANTS, random_k_blocks, write_gguf
from helpers.compare import relative_l2
from helpers.graph_checks import assert_no_graph_breaks, decode_without_recompiles, swap_record
from helpers.kernel_checks import SUM_RTOL, assert_within

from qrt import runtime
from qrt.formats.gguf_blocks import BLOCK_TYPES, superblock_weights
from qrt.kernels import native_cpu, superblock_cpu
from qrt.kernels.choices import choose

pytestmark = pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]  # every kept type but Q8_0 (int8groups runs it)
THRESHOLD = superblock_cpu.MIN_ROWS_DEQUANTIZED


@pytest.fixture(scope="module", autouse=True)
def _library():
    assert native_cpu.available(), native_cpu.why_unavailable()


def file_blocks(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks uint8 [N, K / weights · bytes]: gguf-py's quantization of random weights for the basic
    types, random blocks of the right scale for the K-quants (gguf-py does not quantize to them)."""
    if ggml_type in K_QUANTS:
        blocks = random_k_blocks(ggml_type, n, k, seed)
        if ggml_type != "Q6_K":  # a group with scale 0 and a min: its offset throughout
            blocks.reshape(n, k // 256, -1)[0, 0, 4] &= 0xC0
        return blocks
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    weights[0, :32] = 0.75  # a constant block: Q4_1 and Q5_1 store it with d = 0
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[ggml_type])


def gguf_dequantized(blocks: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]))  # [N, K] fp32


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_fields_dequantize_as_gguf_py_does_bit_for_bit(ggml_type):
    n, k = 128, 512
    blocks = file_blocks(ggml_type, n, k, seed=len(ggml_type))
    w = superblock_weights(torch.from_numpy(blocks), ggml_type, k)
    assert w.bits == BLOCK_TYPES[ggml_type].code_bits and w.q.shape == (n, k)
    assert int(w.q.max()) == 2 ** w.bits - 1  # every bit is read
    assert torch.equal(w.dequantize(), gguf_dequantized(blocks, ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_kernel_computes_the_dequantized_weight_on_both_routes(ggml_type):
    n, k = 192, 512
    blocks = file_blocks(ggml_type, n, k, seed=11)
    w = superblock_weights(torch.from_numpy(blocks), ggml_type, k)
    packed = superblock_cpu.pack_part(w)
    weight = gguf_dequantized(blocks, ggml_type).double()  # [N, K]
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen)
    for m in (1, 3, 5, THRESHOLD + 3):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out = torch.ops.qrt.superblock_linear(x, packed["codes"], packed["sub_scales"], packed["sub_offsets"],
                                              packed["super_scales"], packed["super_offsets"], bias, w.bits, w.zero,
                                              w.group_size)
        expected = x.double() @ weight.t() + bias.double()
        terms = x.double().abs() @ weight.abs().t() + bias.double().abs()  # sum(|terms|) per output
        # Below the threshold the products are exact and summed in fp32; from it W is rounded to
        # bf16 once (half a step, 2^-9 of each term). The output is rounded to bf16 in both.
        weight_rounding = 0.0 if m < THRESHOLD else 2.0**-9
        assert_within(out, expected, (SUM_RTOL + weight_rounding) * terms + 2.0**-8 * expected.abs())


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_0", "Q6_K"])
def test_a_rows_result_does_not_depend_on_its_batch(ggml_type):
    n, k = 128, 256
    w = superblock_weights(torch.from_numpy(file_blocks(ggml_type, n, k, seed=2)), ggml_type, k)
    packed = superblock_cpu.pack_part(w)
    x = torch.randn(THRESHOLD - 1, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def run(rows):
        return torch.ops.qrt.superblock_linear(rows, packed["codes"], packed["sub_scales"], packed["sub_offsets"],
                                               packed["super_scales"], packed["super_offsets"], None, w.bits, w.zero,
                                               w.group_size)

    together = run(x)
    for r in (0, 4, THRESHOLD - 2):
        assert torch.equal(run(x[r:r + 1]), together[r:r + 1])


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_weight_takes_the_files_bits(ggml_type):
    """Codes at their width, and the scales no wider than the file's (its 6-bit K-quant scales
    and mins a byte each): Q6_K, Q4_0 and Q5_0 exactly the file's bytes, Q4_K and Q5_K within 3%."""
    n, k = 64, 512
    blocks = file_blocks(ggml_type, n, k, seed=1)
    packed = superblock_cpu.pack_part(superblock_weights(torch.from_numpy(blocks), ggml_type, k))
    held = sum(t.numel() * t.element_size() for t in packed.values() if t is not None)
    assert packed["codes"].numel() == n * k * BLOCK_TYPES[ggml_type].code_bits // 8
    assert held <= 1.03 * blocks.nbytes
    if ggml_type in ("Q6_K", "Q4_0", "Q5_0", "Q4_1", "Q5_1"):
        assert held == blocks.nbytes


def test_gathered_rows_are_the_dequantized_rows():
    """An embedding tied to an output layer on this kernel looks its rows up in the packed codes."""
    n, k = 192, 512
    for ggml_type in TYPES:
        blocks = file_blocks(ggml_type, n, k, seed=9)
        layer = torch.nn.Module()
        layer.params_dtype = torch.float32
        layer.bias = None
        packed = superblock_cpu.SuperblockLayout().pack([superblock_weights(torch.from_numpy(blocks), ggml_type, k)],
                                                        torch.bfloat16)
        for name, tensor in packed.tensors.items():
            setattr(layer, name, tensor)
        layer.superblock_parts = packed.constants["superblock_parts"]
        ids = torch.tensor([[0, 63, 64], [100, 191, 5]])
        rows = superblock_cpu.SuperblockLayout().rows(layer, ids)  # [2, 3, K]
        assert torch.equal(rows, gguf_dequantized(blocks, ggml_type)[ids]), ggml_type


def test_which_weights_choose_it():
    k = 512
    w = superblock_weights(torch.from_numpy(file_blocks("Q6_K", 64, k, seed=1)), "Q6_K", k)
    narrow = superblock_weights(torch.from_numpy(file_blocks("Q6_K", 96, k, seed=1)), "Q6_K", k)
    assert choose("qrt.superblock_linear", "cpu", parts=[w], dtype=torch.bfloat16).op == "qrt.superblock_linear"
    with pytest.raises(LookupError):  # the products are bf16 pairs: a float32 model runs the 8-bit kernels
        choose("qrt.superblock_linear", "cpu", parts=[w], dtype=torch.float32)
    with pytest.raises(LookupError):  # whole blocks of 64 outputs, in every part
        choose("qrt.superblock_linear", "cpu", parts=[w, narrow], dtype=torch.bfloat16)


# q and k in Q4_K and v in Q6_K (llama.cpp's Q4_K_M mix), gate in Q5_K and up in Q5_0, o in Q4_1,
# down in Q6_K: every fused layer in parts of their own widths.
MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_1", "ffn_gate": "Q5_K",
         "ffn_up": "Q5_0", "ffn_down": "Q6_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed-gguf")
    write_gguf(folder, types=MIXED, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2)
    return folder / "model.gguf"


def test_a_gguf_of_mixed_types_runs_every_layer_at_its_own_width(mixed_gguf):
    stored = runtime.compile_model(mixed_gguf, compile=False, progress=False)  # bf16
    dense = runtime.compile_model(mixed_gguf, "none", compile=False, progress=False, dtype="float32")
    layer = stored.model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    for linear in (qkv, gate_up, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.weight.kernel == "qrt.superblock_linear"
    assert [(p.bits, p.group_size) for p in qkv.superblock_parts] == [(4, 32), (6, 16)]  # q+k, then v
    assert [(p.bits, p.zero) for p in gate_up.superblock_parts] == [(5, 0), (5, 16)]
    assert qkv.part1_weight.kernel == "qrt.superblock_linear"  # each part's call is the recorded kernel's
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert relative_l2(stored(ids).float(), dense(ids)) < 0.02  # bf16 activations


@pytest.mark.slow  # about 20 s; the kernel's op compiles in the default run through the contract's cases
def test_compiled_it_runs_the_kernel_without_recompiling(mixed_gguf):
    dense = runtime.compile_model(mixed_gguf, "none", compile=False, progress=False, dtype="float32")
    compiled = runtime.compile_model(mixed_gguf, progress=False, max_seq_len=64, cache=False)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert relative_l2(compiled(ids).float(), dense(ids)) < 0.02  # bf16 activations
    tokens = decode_without_recompiles(compiled, [4, 8, 15, 16], max_new_tokens=6)
    assert len(tokens) == 6
    # Each layer's calls: q+k and v, o, gate and up, down (the output layer is Q8_0 on 300 rows: dense).
    _, swap = swap_record(compiled.backends["decode"].log)
    assert swap.ops_after.get("qrt.superblock_linear") == 2 * 6
    assert_no_graph_breaks(compiled, "decode")
