"""Hugging Face Hub model ids wherever qrt takes a checkpoint path.

`ORG/NAME` fetches the files qrt reads from a model repository (config, safetensors and their
index, tokenizer files, quantization side files) into the standard Hugging Face cache, with a
progress bar and resumable downloads (huggingface_hub does both). A GGUF repository names its
file: `ORG/NAME:FILE.gguf`, or a quantization tag as llama.cpp's `-hf` takes it
(`ORG/NAME:Q4_K_M`: the one .gguf file whose name holds the tag).

The standard variables apply: HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE=1 (the
cache only), HF_TOKEN (private and gated repositories). They are read when a model is fetched,
not when qrt is imported. A local path that exists always wins over an id.
"""

import os
import re
from pathlib import Path

from qrt.errors import CheckpointError

# What qrt reads from a model repository; everything else (other weight formats, images, the
# original PyTorch checkpoint) is left on the hub.
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# ORG/NAME, then :FILE.gguf or :TAG. Hub names: letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<pick>[\w.+-]+))?$")


def is_hub_id(name) -> bool:
    """Whether `name` reads as a hub id rather than a local path (one that does not exist)."""
    text = str(name)
    return not Path(text).exists() and not text.startswith((".", "/", "~")) and bool(_HUB_ID.match(text))


def locate(name, revision: str | None = None, progress: bool = True, side_files: tuple[str, ...] = ()) -> Path:
    """The local path of checkpoint `name`: itself where it is a local path, else the hub id's
    files in the cache (fetched unless offline). `side_files`: quantization side files to fetch
    beside the config (the formats' own, such as hf_quant_config.json)."""
    if not is_hub_id(name):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids; {name} is a local path")
        return Path(name)
    match = _HUB_ID.match(str(name))
    repo, pick = match["repo"], match["pick"]
    try:
        if pick is None:
            return _fetch_model(repo, revision, progress, side_files)
        return _fetch_gguf(repo, pick, revision, progress)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001  (huggingface_hub's errors, each turned into what to do)
        raise CheckpointError(str(name), None, _advice(repo, revision, err)) from err


def locate_adapter(name, revision: str | None = None, progress: bool = True) -> Path:
    """The local folder of LoRA adapter `name`: itself where it is a local path, else the hub
    id's adapter files (adapter_config.json and adapter_model.safetensors) in the cache."""
    if not is_hub_id(name):
        return Path(name)
    repo = _HUB_ID.match(str(name))["repo"]
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=["adapter_config.json", "adapter_model.safetensors"],
                                      **_options(revision, progress)))
    except Exception as err:  # noqa: BLE001  (huggingface_hub's errors, each turned into what to do)
        raise CheckpointError(str(name), None, _advice(repo, revision, err)) from err


def _options(revision: str | None, progress: bool) -> dict:
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if progress else disable_progress_bars)()
    return dict(revision=revision, cache_dir=hub_cache(), local_files_only=offline(),
                token=os.environ.get("HF_TOKEN") or None)


def hub_cache() -> Path:
    """The cache folder huggingface_hub uses, from the variables as they are now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _fetch_model(repo: str, revision: str | None, progress: bool, side_files: tuple[str, ...]) -> Path:
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo, allow_patterns=[*_MODEL_FILES, *side_files], **_options(revision, progress)))
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    hint = (f"; it holds GGUF files, so name one: {repo}:{ggufs[0]}" if ggufs
            else "; is it a model repository with a config.json?")
    raise CheckpointError(repo, "config.json", f"not in the repository's files qrt reads{hint}")


def _fetch_gguf(repo: str, pick: str, revision: str | None, progress: bool) -> Path:
    from huggingface_hub import hf_hub_download

    options = _options(revision, progress)
    if pick.lower().endswith(".gguf"):
        filename = pick
    else:
        names = _gguf_names(repo, options)
        chosen = [n for n in names if pick.lower() in Path(n).name.lower()]
        if len(chosen) != 1:
            found = ", ".join(names) or "none"
            raise CheckpointError(repo, None, f"{len(chosen)} .gguf files match the tag {pick!r} (its .gguf files: "
                                              f"{found}); name the file, as {repo}:FILE.gguf")
        filename = chosen[0]
    return Path(hf_hub_download(repo, filename, **options))


def _gguf_names(repo: str, options: dict) -> list[str]:
    """The repository's .gguf files: from the hub, or offline from the cached snapshot."""
    if options["local_files_only"]:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo, allow_patterns=["*.gguf"], **options))
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf"))
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(repo, revision=options["revision"], token=options["token"])
    return sorted(name for name in files if name.lower().endswith(".gguf"))


def _advice(repo: str, revision: str | None, err: Exception) -> str:
    """What went wrong fetching `repo`, and what to do about it."""
    from huggingface_hub import errors

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(err, errors.GatedRepoError):
        return (f"the repository is gated{at}: accept its terms on huggingface.co, then set HF_TOKEN to a token "
                f"of that account")
    if isinstance(err, errors.RepositoryNotFoundError):
        return ("no such repository on the hub (or it is private: set HF_TOKEN to a token that can read it); "
                "check the id, or give a local path")
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the repository has no revision {revision!r}; give a branch, tag or commit it has"
    if isinstance(err, errors.LocalEntryNotFoundError) or offline():
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        return (f"not a local path, and not in the Hugging Face cache ({hub_cache()}){at} while {why}; run once "
                f"with the hub reachable, or fetch it with `hf download {repo}`, or give a local path")
    if isinstance(err, errors.EntryNotFoundError):
        return f"the file is not in the repository{at}: {err}"
    return f"could not fetch it from the hub{at}: {type(err).__name__}: {err}"
