"""On a CUDA device, the whole path a GPU user takes: `compile_model(..., device="cuda")` loads
the checkpoint into the CUDA layouts, the swap and fusion passes put qrt's Triton kernels in the
graph, and Inductor compiles the rest for the GPU. Skipped where there is no CUDA device; CI's
machines have none, so these run wherever a GPU is at hand (`pytest tests/test_cuda.py`).

Two references, both run on the CPU in float32 so that only the GPU side's arithmetic is new:
- every format's tiny checkpoint (helpers/checkpoints/format_cases) against the eager model on
  the CUDA layouts, whose reference ops compute what the Triton kernels should
  (test_format_contract's tolerances);
- the real producers' checkpoints (tests/producers; the folder $QRT_PRODUCER_KIT, any subset
  of the kit's variants) against qrt's eager float32 model, which test_producers.py holds to the
  producers' own references.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.checkpoints.format_cases import CASES
from helpers.compare import relative_l2
from helpers.graph_checks import no_recompiles
from helpers.tp_worker import teacher_forced_logits
from test_format_contract import CONTRACT_IDS, DECODE_STEPS, MAX_SEQ_LEN, TOLERANCE
from test_format_contract import case_folder  # noqa: F401  (a fixture)

from qrt import runtime
from qrt.checkpoint.config import DeviceConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# 40 byte tokens, as test_producers.py: a 16-token prompt chunk, then 24 decode steps.
IDS = list(b"Quantized checkpoints from real producers.")[:40]
PREFILL = 16
# Producer variants whose activations are rounded (to e4m3 or int8): an input within summation
# noise of a rounding edge rounds one way on one device and the other way on the other, and the
# step grows through the layers; test_producers.py measures that drift of the reference itself at
# up to 4.6e-2 and bounds whole-model runs at DRIFT_FACTOR (4) times it. Weight-only variants
# dequantize exactly on both sides and differ by the sums' order and the GPU's float32 MMAs.
ROUNDED_ACTIVATIONS_BOUND = 0.2
WEIGHT_ONLY_BOUND = 1e-3


def _kernels_in_place(model) -> set[str]:
    """The kernels the loader recorded on the model's quantized linears and experts."""
    return {p.kernel for m in model.model.modules() if getattr(m, "quant_method", None) is not None
            for p in m.parameters(recurse=False) if getattr(p, "kernel", "aten.linear") != "aten.linear"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_on_cuda_matches_the_eager_reference_in_one_graph_per_role(name, case_folder):  # noqa: F811
    case = CASES[name]
    folder = case_folder(name)
    model = runtime.compile_model(folder, case.quant, device="cuda", progress=False, max_seq_len=MAX_SEQ_LEN)
    eager = runtime.compile_model(folder, case.quant, compile=False, progress=False, max_seq_len=MAX_SEQ_LEN,
                                  device_config=DeviceConfig("cpu", kernel_device="cuda"))
    assert _kernels_in_place(model) == case.cuda_kernels
    with torch.no_grad():
        error = relative_l2(model(CONTRACT_IDS.cuda()).cpu(), eager(CONTRACT_IDS))
    print(f"{name}: forward logits off by {error:.2e}")
    assert error < TOLERANCE.get(name, 1e-4), error
    model.generate([3, 4, 5], max_new_tokens=2, stop_at_eos=False)
    with no_recompiles(model):
        model.generate(list(range(20, 31)), max_new_tokens=DECODE_STEPS, stop_at_eos=False)
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 1}
    for role in model.compile_report():  # the roles that compiled
        (graph,) = model.backends[role].log.graphs
        assert {c.kernel for c in graph.kernel_choices} == case.cuda_kernels, role


def _kit_variants() -> list[str]:
    kit = os.environ.get("QRT_PRODUCER_KIT")
    if not kit or not Path(kit).is_dir():
        return []
    return sorted(p.name for p in Path(kit).iterdir() if (p / "config.json").exists() and (p / "kit.json").exists())


@pytest.mark.parametrize("name", _kit_variants() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no producer kit: set QRT_PRODUCER_KIT to a folder of its variants"))])
def test_producer_checkpoint_compiled_on_cuda_matches_qrts_float32_eager_model(name):
    folder = Path(os.environ["QRT_PRODUCER_KIT"]) / name
    info = json.loads((folder / "kit.json").read_text())
    eager = runtime.compile_model(folder, dtype=torch.float32, compile=False, cache=False, progress=False,
                                  max_seq_len=64)
    model = runtime.compile_model(folder, dtype=torch.float32, device="cuda", progress=False, warmup=False,
                                  max_seq_len=64)
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL).cpu(), teacher_forced_logits(eager, IDS, PREFILL))
    rounded = info.get("activation_quant") is not None
    print(f"{name} ({info.get('scheme')}, activations {info.get('activation_quant')}): logits off by {error:.2e}")
    assert error < (ROUNDED_ACTIVATIONS_BOUND if rounded else WEIGHT_ONLY_BOUND), error
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 0}, model.compile_report()
