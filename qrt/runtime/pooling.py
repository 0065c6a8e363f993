"""How an embedding model turns a text's final hidden states into one vector: which pooling, and
whether the vector is L2-normalized. Read from a sentence-transformers folder (modules.json,
1_Pooling/config.json), or asked for by the caller (compile_model's `pooling=`).

Two poolings, those of decoder models used as encoders: "last", the last token's hidden state
(Qwen3-Embedding: the causal model has read the whole text there), and "mean", the mean over the
text's tokens."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qrt.errors import ConfigError, UnsupportedError

KINDS = ("last", "mean")
# sentence-transformers' pooling modes (its `pooling_mode`, or the older `pooling_mode_*` flags) -> qrt's.
_MODES = {"lasttoken": "last", "mean": "mean"}
_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
          "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
          "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class Pooling:
    """kind: "last" or "mean"; normalize: L2-normalize the pooled vector (then `dimensions` may
    shorten it, Matryoshka-style: the first d values, normalized again)."""

    kind: str
    normalize: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"pooling {self.kind!r}: choose one of {list(KINDS)}")

    def pool(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] (each row's tokens first, then padding), lengths [B] of the rows'
        tokens -> float32 [B, D], normalized where this pooling normalizes."""
        hidden = hidden.float()
        if self.kind == "last":
            pooled = hidden[torch.arange(hidden.shape[0]), lengths - 1]  # [B, D]
        else:
            real = torch.arange(hidden.shape[1])[None, :] < lengths[:, None]  # [B, T] bool
            pooled = (hidden * real[..., None]).sum(dim=1) / lengths[:, None].float()  # [B, D]
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled

    def check_dimensions(self, dimensions: int | None, full: int) -> None:
        """ValueError unless `dimensions` (None: all) can shorten this pooling's vectors of `full`
        values: only a normalizing pooling allows it (a cut of a raw vector has no scale to keep)."""
        if dimensions is None:
            return
        if not self.normalize:
            raise ValueError("dimensions needs an embedding model whose vectors are normalized; this model's "
                             "pooling does not normalize, so its vectors cannot be shortened")
        if not (isinstance(dimensions, int) and not isinstance(dimensions, bool) and 1 <= dimensions <= full):
            raise ValueError(f"dimensions must be an integer from 1 to {full} (the model's), got {dimensions!r}")

    def shorten(self, vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """vectors [B, D] cut to their first `dimensions` values and normalized again (None: as
        they are); check_dimensions first."""
        if dimensions is None:
            return vectors
        self.check_dimensions(dimensions, vectors.shape[-1])
        return F.normalize(vectors[:, :dimensions], p=2, dim=-1)  # [B, dimensions]


def read_pooling(folder: Path) -> Pooling | None:
    """The pooling of a sentence-transformers checkpoint folder (modules.json listing its
    Transformer, Pooling and, optionally, Normalize modules); None for a folder without
    modules.json. Modules qrt does not run (a Dense projection, say) are refused, not skipped."""
    folder = Path(folder)
    listing = folder / "modules.json"
    if not listing.is_file():
        return None
    modules = _json(listing)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{listing}: expected a list of modules")
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [kind for kind in kinds if kind not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise UnsupportedError(f"{listing}: modules {unknown} are not supported; qrt runs a Transformer, its Pooling "
                               f"and an optional Normalize")
    if kinds.count("Pooling") != 1 or "Transformer" not in kinds:
        raise UnsupportedError(f"{listing}: expected one Transformer and one Pooling module, got {kinds}")
    transformer = modules[kinds.index("Transformer")]
    if transformer.get("path", "") not in ("", "."):
        raise UnsupportedError(f"{listing}: the Transformer module is in {transformer['path']!r}; qrt reads it from "
                               f"the folder itself (config.json and the weights beside modules.json)")
    pooling_path = folder / modules[kinds.index("Pooling")].get("path", "1_Pooling") / "config.json"
    return Pooling(_pooling_kind(pooling_path), normalize="Normalize" in kinds)


def _pooling_kind(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"{path}: missing; modules.json lists a Pooling module there")
    config = _json(path)
    mode = config.get("pooling_mode")
    modes = [mode] if isinstance(mode, str) else list(mode or [])
    if mode is None:
        modes = [name for flag, name in _FLAGS.items() if config.get(flag)] or ["mean"]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise UnsupportedError(f"{path}: pooling {modes}; qrt supports one of {list(_MODES)} "
                               f"(last-token or mean pooling)")
    return _MODES[modes[0]]


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not readable JSON ({err})") from None


def choose_pooling(asked, folder: Path | None, base_model: bool, source) -> Pooling | None:
    """The pooling of compile_model's `pooling=` argument: a Pooling, "last" or "mean" (both
    normalized), or None to read it from the checkpoint folder (None: not an embedding model).
    base_model: config.json names a model without an lm_head, which can only embed."""
    if isinstance(asked, Pooling):
        return asked
    if isinstance(asked, str):
        return Pooling(asked)
    if asked is not None:
        raise ValueError(f"pooling={asked!r}: give 'last', 'mean', a qrt.runtime.pooling.Pooling, or None")
    found = read_pooling(folder) if folder is not None else None
    if found is None and base_model:
        raise UnsupportedError(f"{source}: a base model without an lm_head, and no sentence-transformers modules.json "
                               f"says how to pool it; it runs only as an embedding model: pass pooling='last' or "
                               f"'mean' to compile_model")
    return found
