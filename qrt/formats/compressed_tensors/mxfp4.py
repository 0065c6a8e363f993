"""compressed-tensors `mxfp4-pack-quantized` (llm-compressor's MXFP4A16 scheme): the OCP microscaling
FP4 of ../mxfp4.py in compressed-tensors' names (docs/formats.md §3.9).

Tensors per linear, in nn.Linear orientation:
- `weight_packed`, uint8 [N, K / 2]: two E2M1 codes a byte along K, the even channel in the low
  nibble (the byte order of gpt-oss's blocks, flattened);
- `weight_scale`, uint8 [N, K / 32]: each block's E8M0 exponent e, its scale 2 ** (e - 127)
  (compressed-tensors writes floor(log2(scale)) + 127).
No global scale (the scheme's strategy is `group`, not NVFP4's `tensor_group`).
"""

from qrt.errors import UnsupportedError
from qrt.formats.mxfp4 import BLOCK, Mxfp4LinearMethod, Mxfp4Tensors
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format
from qrt.formats.scheme import QuantScheme

FORMAT = "mxfp4-pack-quantized"
_CT_TENSORS = Mxfp4Tensors("weight_packed", "weight_scale", codes_in_blocks=False, note="MXFP4A16 (compressed-tensors)")


def _check_weights(args: dict, source) -> None:
    wanted = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK, "symmetric": True}
    found = {key: args.get(key, True if key == "symmetric" else None) for key in wanted}
    if found != wanted:
        raise UnsupportedError(f"{source}: compressed-tensors format {FORMAT!r} with weights {found} is not supported; "
                               f"supported: {wanted}")


@compressed_tensors_format(FORMAT, computes=("qrt.lut4_linear",),
                           summary="MXFP4A16: FP4 E2M1 weights, an E8M0 scale per 32 input channels; "
                           "activations unquantized",
                           matches=lambda g: g.fmt == FORMAT)
def ct_mxfp4_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    _check_weights(group.weights, source)
    if group.inputs is not None:
        raise UnsupportedError(f"{source}: compressed-tensors {FORMAT!r} with quantized input activations (the MXFP4 "
                               f"scheme) is not supported; weight-only MXFP4A16 is")
    return QuantScheme("compressed-tensors", lambda names: Mxfp4LinearMethod(_CT_TENSORS, names), skip,
                       "compressed-tensors MXFP4A16 (e8m0 scales per 32)")
