"""AutoAWQ's variants: AWQ GEMM checkpoints (4-bit, group 128, zero point) quantized on the CPU,
each with the dense reference that AutoAWQ's own dequant_gemm (awq.utils.packing_utils, the
unpacking its WQLinear_GEMM uses without the CUDA extension) makes of the saved tensors.

AWQ folds its activation scales into the preceding norms and linears, so the reference's norms
(copied from the checkpoint) differ from the base's, and so do its weights by more than rounding.

Usage (inside the AutoAWQ venv): python autoawq_variants.py VARIANT BASE_ROOT OUT_FOLDER, or --list"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

QUANT_CONFIG = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
SCHEME = "AWQ int4 group-128 asymmetric (zero point), GEMM packing"


def cpu_safe_quantizer():
    """AwqQuantizer with its scale search fixed for the CPU.

    _compute_best_scale keeps the weights to restore after each of its 20 trial scales as
    `{k: v.cpu() for k, v in module.state_dict().items()}`: on a GPU that is a copy, on the CPU the
    very tensors the trial then scales in place (`fc.weight.mul_(scales)`), so the "restored"
    weights drift (found: q/k/v came out scaled by s squared while the norm was divided by s once,
    and the scales-only model was off the base by 0.88 relative in its logits). Here state_dict()
    hands that search clones, which is what the GPU path gets."""
    from awq.quantize.quantizer import AwqQuantizer

    class CpuSafeAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs={}):
            state_dict = module2inspect.state_dict
            module2inspect.state_dict = lambda *args, **kw: {
                name: tensor.clone() for name, tensor in state_dict(*args, **kw).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale,
                                                   fp16_output, kwargs)
            finally:
                del module2inspect.state_dict  # the instance attribute; the class's method is back

    return CpuSafeAwqQuantizer


# name: base architecture
VARIANTS = {
    "autoawq-w4g128-gemm": "llama",
    "autoawq-w4g128-gemm-qwen2": "qwen2",
}


def main(variant: str, base_root: Path, out: Path) -> None:
    """Quantize VARIANTS[variant]'s base into `out`, then write out/reference and out/kit.json."""
    import torch
    from transformers import AutoTokenizer

    import awq
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm

    arch = VARIANTS[variant]
    base = base_root / arch
    model = AutoAWQForCausalLM.from_pretrained(str(base), torch_dtype=torch.float16)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    ids = base_models.calibration_ids()
    model.quantize(tokenizer, quant_config=QUANT_CONFIG, calib_data=ids.tolist(),
                   max_calib_samples=ids.shape[0], max_calib_seq_len=ids.shape[1],
                   quantizer_cls=cpu_safe_quantizer())
    model.save_quantized(str(out))
    del model
    base_models.copy_tokenizer(base, out)

    saved = base_models.load_tensors(out)
    tensors, quantized = {}, []
    for name, tensor in saved.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            weight = dequantize_gemm(saved[name], saved[module + ".qzeros"], saved[module + ".scales"].float(),
                                     QUANT_CONFIG["w_bit"], QUANT_CONFIG["q_group_size"])
            tensors[module + ".weight"] = weight.t()  # dequantize_gemm gives [in, out]
            quantized.append(module)
        elif not name.endswith((".qzeros", ".scales")):
            tensors[name] = tensor.float()
    base_models.write_reference(out, base, tensors)
    base_models.write_kit(
        out, producer="autoawq", version=awq.__version__, architecture=arch, scheme=SCHEME,
        activation_quant=None, kv_cache=None, quantized_modules=sorted(quantized))
    print(json.dumps(json.loads((out / "config.json").read_text())["quantization_config"]))


if __name__ == "__main__":
    base_models.cli(VARIANTS, main)
