"""Checks each built variant's reference against its base model, with the transformers the project
uses, and records the numbers in the variant's kit.json under "verification".

- The reference loads with AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) with no
  missing or unexpected tensors, and its config has no quantization_config.
- Each quantized weight differs from the base weight (the quantizer did something) by quantization
  error only: a relative error (Frobenius) under WEIGHT_BOUND. Producers that move activation scales
  into the weights (AWQ, SmoothQuant: the checkpoint's norms differ from the base's) change the
  weights by far more than that, so for them only the logits are bounded.
- The logits of the reference and of the base on calibration text agree within LOGITS_BOUND
  (relative), so the reference computes the base's function up to quantization error.

Usage (inside the base venv): python verify.py KIT_FOLDER BASE_ROOT VARIANT..."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import base_models  # noqa: E402

# A transposed, misordered or mis-scaled dequantization gives relative errors near 1 or more. Seen on
# these bases: weights 0.01-0.3 (int8 to int4); logits 0.01 (int8) to 0.2 (int4), 0.5 for 2:4 + int4.
WEIGHT_BOUND = 0.7
LOGITS_BOUND = 0.8


def verify(variant: Path, base_root: Path) -> dict:
    """Check `variant`'s reference (see the module docstring); return the numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    kit = json.loads((variant / "kit.json").read_text())
    base = base_root / kit["architecture"]
    config = json.loads((variant / "reference" / "config.json").read_text())
    assert "quantization_config" not in config, "the reference config has a quantization_config"
    reference, info = AutoModelForCausalLM.from_pretrained(
        str(variant / "reference"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"reference loading: {info}"
    reference_tensors = base_models.load_tensors(variant / "reference")
    base_tensors = {name: tensor.float() for name, tensor in base_models.load_tensors(base).items()}

    weight_errors = {}
    for module in kit["quantized_modules"]:
        ref, orig = reference_tensors[module + ".weight"], base_tensors[module + ".weight"]
        difference = (ref - orig).abs().max().item()
        assert difference > 0, f"{module}: the reference weight equals the base weight"
        weight_errors[module] = (difference, ((ref - orig).norm() / orig.norm()).item())
    unquantized = [name for name in base_tensors if name.removesuffix(".weight") not in kit["quantized_modules"]]
    rescaled = sorted(name for name in unquantized if not torch.equal(reference_tensors[name], base_tensors[name]))
    worst = max(weight_errors.values(), key=lambda error: error[1])
    if not rescaled:
        assert worst[1] < WEIGHT_BOUND, f"a weight's relative error is {worst[1]:.3f}"

    base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    ids = base_models.calibration_ids(samples=2)
    with torch.no_grad():
        expected = base_model(ids).logits
        got = reference(ids).logits
    logits_error = ((got - expected).norm() / expected.norm()).item()
    assert logits_error < LOGITS_BOUND, f"the reference's logits are off by {logits_error:.3f} (relative)"
    return {
        "weight_max_abs_diff": max(error[0] for error in weight_errors.values()),
        "weight_relative_error_max": worst[1],
        "unquantized_tensors_changed": rescaled,  # by the producer, e.g. norms that took AWQ's scales
        "logits_relative_error": logits_error,
    }


def main(kit: Path, base_root: Path, variants: list[str]) -> None:
    """Verify each variant; a failure is printed and recorded, and makes the exit status 1."""
    failed = False
    for name in variants:
        folder = kit / name
        record = json.loads((folder / "kit.json").read_text())
        try:
            record["verification"] = verify(folder, base_root)
            numbers = record["verification"]
            print(f"verified {name}: weight max abs diff {numbers['weight_max_abs_diff']:.4g}, "
                  f"relative {numbers['weight_relative_error_max']:.3f}"
                  f"{' (norms rescaled by the producer)' if numbers['unquantized_tensors_changed'] else ''}, "
                  f"logits relative error {numbers['logits_relative_error']:.4f}", flush=True)
        except Exception as error:  # recorded, so that one bad variant does not hide the others
            record["verification"] = {"error": f"{type(error).__name__}: {error}"}
            print(f"verification FAILED for {name}: {error}", flush=True)
            failed = True
        (folder / "kit.json").write_text(json.dumps(record, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
