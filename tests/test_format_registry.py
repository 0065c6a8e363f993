"""The format registry is the one list of formats: the README's table, the CLI's help and the
errors' "supported: ..." lists all come from it."""

import re
from pathlib import Path

import pytest

from qrt.errors import UnsupportedError
from qrt.formats.resolve import resolve_scheme
from qrt.formats.catalog import (compressed_tensors_formats, formats_markdown, online_formats, side_file_formats,
                                 stored_formats)
from qrt.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_format_table_is_the_registry():
    text = README.read_text()
    block = re.search(r"<!-- qrt formats --markdown -->\n(.*?)\n<!-- end of qrt formats -->", text, re.S)
    assert block is not None, "README.md lost its formats block"
    assert block.group(1) == formats_markdown(), "README.md's format table is stale: paste `qrt formats --markdown`"


def test_every_registered_format_is_in_the_table():
    table = formats_markdown()
    names = [*stored_formats(), *compressed_tensors_formats(), *side_file_formats(), *online_formats()]
    assert len(names) >= 16
    for name in names:
        assert name in table


def test_quant_help_lists_the_online_formats():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = next(a.help for a in generate._actions if "--quant" in a.option_strings)
    for name in online_formats():
        assert name in help_text


def test_unknown_online_format_error_lists_the_registry():
    with pytest.raises(UnsupportedError) as err:
        resolve_scheme({}, "nf4", "config.json")
    assert f"one of {sorted(online_formats())}" in str(err.value)


def test_unknown_stored_format_error_lists_the_registry():
    with pytest.raises(UnsupportedError) as err:
        resolve_scheme({"quantization_config": {"quant_method": "hqq"}}, None, "config.json")
    assert f"supported: {sorted(stored_formats())}" in str(err.value)


def test_unknown_compressed_tensors_group_lists_the_sub_formats():
    config = {"quant_method": "compressed-tensors",
              "config_groups": {"g": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                      "weights": {"type": "float", "num_bits": 4}}}}
    with pytest.raises(UnsupportedError) as err:
        resolve_scheme({"quantization_config": config}, None, "config.json")
    assert "'nvfp4-pack-quantized'" in str(err.value)
    config["config_groups"]["g"]["weights"] = {"type": "int4"}
    with pytest.raises(UnsupportedError) as err:
        resolve_scheme({"quantization_config": config}, None, "config.json")
    for name in compressed_tensors_formats():
        assert name in str(err.value)


def test_compressed_tensors_transforms_are_refused():
    config = {"quant_method": "compressed-tensors", "transform_config": {"config_groups": {"r": {"type": "hadamard"}}},
              "config_groups": {"g": {"format": "pack-quantized", "targets": ["Linear"],
                                      "weights": {"type": "int", "num_bits": 4, "strategy": "group",
                                                  "group_size": 128}}}}
    with pytest.raises(UnsupportedError, match="transform_config"):
        resolve_scheme({"quantization_config": config}, None, "config.json")


def test_a_format_registers_once():
    from qrt.formats.registry import online_format

    with pytest.raises(ValueError, match="registered twice"):
        online_format("fp8", summary="again", computes=("qrt.fp8_linear",))(lambda names: None)


def test_every_format_names_ops_that_kernels_compute_on_the_cpu_and_the_gpu():
    """The format table's kernels column: each format's logical ops have kernels declared on both
    devices (the compressed-tensors entry defers to its sub-formats)."""
    from qrt.formats.catalog import (compressed_tensors_formats, kernels_of, online_formats, side_file_formats,
                                     stored_formats)
    from qrt.kernels.choices import declared

    entries = [*stored_formats().values(), *compressed_tensors_formats().values(), *side_file_formats().values(),
               *online_formats().values()]
    for entry in entries:
        if entry is stored_formats()["compressed-tensors"]:
            assert entry.computes == () and kernels_of(entry.computes) == "those of its sub-format"
            continue
        assert entry.computes, entry
        for device in ("cpu", "cuda"):
            assert any(set(k.serves) & set(entry.computes) and device in k.devices for k in declared().values()), \
                (entry, device)
    assert kernels_of(("qrt.lut4_linear",)).startswith("CPU: `lut4_pairs_linear`, `lut4_linear`; GPU:")


def test_a_device_without_a_kernel_for_the_format_is_named(llama_dir):
    from qrt import runtime
    from qrt.checkpoint.config import DeviceConfig

    with pytest.raises(UnsupportedError, match=r"model\.layers\.0\.self_attn\.qkv_proj: fp8 weights cannot run on "
                                               r"mps: no kernel computes qrt\.fp8_linear on mps"):
        runtime.compile_model(llama_dir, "fp8", compile=False, progress=False,
                              device_config=DeviceConfig("cpu", kernel_device="mps"))
