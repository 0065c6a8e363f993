"""Builds the producer kit: small checkpoints quantized by the real producers (GPTQModel, AutoAWQ,
llm-compressor, NVIDIA ModelOpt), each with a dense float32 reference of the producer's own
dequantized weights, for testing qrt's loaders against what others made. See README.md.

    python tests/producers/build.py [--out DIR] [--only NAME,...]

Runs with any Python 3.11 (it needs no package): each producer gets a virtualenv of its own pins
(requirements-*.txt) under ~/.cache/qrt/producer-venvs/, and every step runs in a subprocess of
that venv's python with a timeout. The kit goes to --out, else $QRT_PRODUCER_KIT, else
~/.cache/qrt/producer-kit/<hash of the kit's scripts and pins>; a kit whose kit.json lists every
variant (built or failed) is reused as it is. Exit status 1 when a variant failed."""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE.parent / "tiny_tokenizer.py"  # base_models imports it
CACHE = Path.home() / ".cache" / "qrt"
TORCH_PIN = "torch==2.13.0"  # the CPU build; an unpinned torch would bring a multi-GB CUDA one

# producer: (script, requirements name, prefix of its variant names)
PRODUCERS = {
    "gptqmodel": ("gptqmodel_variants.py", "gptqmodel", "gptqmodel-"),
    "autoawq": ("autoawq_variants.py", "autoawq", "autoawq-"),
    "llmcompressor": ("llmcompressor_variants.py", "llmcompressor", "llmc-"),
    "modelopt": ("modelopt_variants.py", "modelopt", "modelopt-"),
    "bitsandbytes": ("bitsandbytes_variants.py", "bitsandbytes", "bnb-"),
}
PIP_TIMEOUT = 1800  # torch alone is a 190 MB wheel
VARIANT_TIMEOUT = 900  # each takes 5-35 s here; a hang must not stall the kit
STEP_TIMEOUT = 600  # base models, listing variants, verification


def _digest(paths) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def kit_hash() -> str:
    """A short hash of what every variant depends on: the base models and reference writers
    (base_models.py), the checks (verify.py), the base venv's pins and the tokenizer. A change to
    one of them gives a new kit folder."""
    return _digest([HERE / "base_models.py", HERE / "verify.py", HERE / "requirements-base.txt", TOKENIZER])


def producer_hash(producer: str) -> str:
    """A short hash of one producer's script and pins: a variant built with another is rebuilt, so
    that changing one producer rebuilds only its variants."""
    script, requirements, _ = PRODUCERS[producer]
    return _digest([HERE / script, HERE / f"requirements-{requirements}.txt"])


def default_kit_folder() -> Path:
    """Where the kit goes without --out: $QRT_PRODUCER_KIT, else the cache, by the kit's hash."""
    return Path(os.environ.get("QRT_PRODUCER_KIT") or CACHE / "producer-kit" / kit_hash()).expanduser().resolve()


def log(message: str) -> None:
    print(f"[producer-kit] {message}", flush=True)


def run(command: list, timeout: int, log_file: Path) -> None:
    """Run `command` with its output appended to `log_file`; raise with the log's tail on failure."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Nothing comes from the hub: the bases and calibration data are made locally.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as output:
        output.write(f"$ {' '.join(map(str, command))}\n")
        output.flush()
        try:
            result = subprocess.run([str(part) for part in command], stdout=output, stderr=subprocess.STDOUT,
                                    env=env, timeout=timeout, cwd=HERE)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout} s; see {log_file}") from None
    if result.returncode:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"exit status {result.returncode}: {tail[0] if tail else ''} (see {log_file})")


def ensure_venv(requirements: str, logs: Path) -> Path:
    """The python of the venv for requirements-<requirements>.txt, made first if needed: torch's CPU
    build first, then every pin with --no-deps, so that no resolver can swap torch. A venv counts
    only once its `.complete` marker is written; a half-made one is made again."""
    pins = HERE / f"requirements-{requirements}.txt"
    key = hashlib.sha256(pins.read_bytes() + TORCH_PIN.encode() + sys.version.encode()).hexdigest()[:12]
    venv = CACHE / "producer-venvs" / f"{requirements}-{key}"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    log(f"making the {requirements} venv at {venv}")
    venv_log = logs / f"venv-{requirements}.log"
    run([sys.executable, "-m", "venv", venv], STEP_TIMEOUT, venv_log)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    run([*pip, TORCH_PIN], PIP_TIMEOUT, venv_log)
    run([*pip, "--no-deps", "-r", pins], PIP_TIMEOUT, venv_log)
    (venv / ".complete").write_text(pins.read_text())
    log(f"{requirements} venv ready in {time.monotonic() - started:.0f} s")
    return python


def list_variants(python: Path, script: str, logs: Path) -> list[str]:
    """The variant names a producer script defines (its --list)."""
    result = subprocess.run([str(python), script, "--list"], capture_output=True, text=True, cwd=HERE,
                            timeout=STEP_TIMEOUT)
    if result.returncode:
        (logs / f"list-{script}.log").write_text(result.stdout + result.stderr)
        raise RuntimeError(f"{script} --list failed: {result.stderr.strip().splitlines()[-1:]}")
    return result.stdout.split()


def build_variant(python: Path, script: str, name: str, kit: Path, logs: Path) -> None:
    """Build one variant into kit/.partial/<name>, and move it to kit/<name> once it is whole."""
    partial = kit / ".partial" / name
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    run([python, script, name, kit / "base", partial], VARIANT_TIMEOUT, logs / f"{name}.log")
    if not (partial / "kit.json").exists():
        raise RuntimeError(f"{script} wrote no kit.json for {name}")
    shutil.rmtree(kit / name, ignore_errors=True)
    partial.rename(kit / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="kit folder (default: $QRT_PRODUCER_KIT or the cache)")
    parser.add_argument("--only", help="comma-separated variant names or producer names")
    args = parser.parse_args()
    digest = kit_hash()
    kit = args.out.expanduser().resolve() if args.out else default_kit_folder()
    logs = kit / "logs"
    summary_path = kit / "kit.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    only = set(args.only.split(",")) if args.only else None
    producers = [name for name, (_, _, prefix) in PRODUCERS.items()
                 if only is None or name in only or any(item.startswith(prefix) for item in only)]
    hashes = {producer: producer_hash(producer) for producer in PRODUCERS}
    if only is None and summary.get("complete") and summary.get("producer_hashes") == hashes:
        log(f"kit already built: {kit}")
        print(kit)
        return 0 if not summary.get("failed") else 1

    started = time.monotonic()
    kit.mkdir(parents=True, exist_ok=True)
    seconds = summary.get("seconds", {})
    built, failed = set(summary.get("built", [])), dict(summary.get("failed", {}))
    versions = summary.get("producers", {})
    listed = summary.get("variants", {})  # producer: the variant names its script defines

    base_python = ensure_venv("base", logs)
    if not (kit / "base" / ".complete").exists():
        step = time.monotonic()
        log("making the base models")
        shutil.rmtree(kit / "base", ignore_errors=True)
        run([base_python, "base_models.py", kit / "base"], STEP_TIMEOUT, logs / "base.log")
        (kit / "base" / ".complete").write_text(digest)
        seconds["base models"] = round(time.monotonic() - step, 1)

    wanted = []
    for producer in producers:
        script, requirements, _ = PRODUCERS[producer]
        step = time.monotonic()
        try:
            python = ensure_venv(requirements, logs)
            names = list_variants(python, script, logs)
        except Exception as error:  # the producer's venv: all its variants fail alike
            log(f"{producer}: FAILED to set up: {error}")
            failed[producer] = f"venv: {error}"
            continue
        seconds.setdefault(f"venv {requirements}", round(time.monotonic() - step, 1))
        failed.pop(producer, None)
        listed[producer] = names
        selected = [name for name in names if only is None or producer in only or name in only]
        wanted += selected
        for index, name in enumerate(selected, 1):
            record = kit / name / "kit.json"
            if name in built and record.exists() and json.loads(record.read_text()).get("producer_hash") == hashes[producer]:
                continue
            log(f"{producer} [{index}/{len(selected)}] {name} ...")
            step = time.monotonic()
            try:
                build_variant(python, script, name, kit, logs)
            except Exception as error:
                log(f"{name}: FAILED: {error}")
                failed[name] = str(error)
                built.discard(name)
                continue
            seconds[name] = round(time.monotonic() - step, 1)
            record = json.loads((kit / name / "kit.json").read_text())
            record["producer_hash"] = hashes[producer]
            (kit / name / "kit.json").write_text(json.dumps(record, indent=2))
            versions[producer] = record["version"]
            failed.pop(name, None)
            built.add(name)
            log(f"{name} built in {seconds[name]:.0f} s")
    if only:
        unknown = only - set(wanted) - set(PRODUCERS)
        if unknown:
            log(f"unknown variants: {', '.join(sorted(unknown))}")

    unverified = [name for name in sorted(built) if "verification" not in json.loads((kit / name / "kit.json").read_text())]
    if unverified:
        step = time.monotonic()
        log(f"verifying {len(unverified)} references against the base models")
        try:
            run([base_python, "verify.py", kit, kit / "base", *unverified], STEP_TIMEOUT, logs / "verify.log")
        except RuntimeError:
            pass  # each variant's verdict is in its kit.json, read below
        seconds["verification"] = round(time.monotonic() - step, 1)
    for name in sorted(built):
        verification = json.loads((kit / name / "kit.json").read_text()).get("verification", {})
        if "error" in verification or not verification:
            failed[name] = f"verification: {verification.get('error', 'not run')}"
            log(f"{name}: verification FAILED: {failed[name]}")
        else:
            log(f"{name}: weight max abs diff {verification['weight_max_abs_diff']:.4g} "
                f"(relative {verification['weight_relative_error_max']:.3f}), "
                f"logits relative error {verification['logits_relative_error']:.4f}")
    built -= set(failed)

    shutil.rmtree(kit / ".partial", ignore_errors=True)
    seconds["total (this run)"] = round(time.monotonic() - started, 1)
    # Complete: every producer's every variant was tried (or its venv failed), in this run or before.
    complete = all(producer in failed or (producer in listed and set(listed[producer]) <= built | set(failed))
                   for producer in PRODUCERS)
    summary = {
        "kit_hash": digest,
        "producer_hashes": hashes,
        "complete": complete,
        "producers": versions,
        "variants": listed,
        "base_models": sorted(path.name for path in (kit / "base").iterdir() if path.is_dir()),
        "built": sorted(built),
        "failed": failed,
        "seconds": seconds,
    }
    # Written beside and renamed into place: tests read it to find the kit, possibly while it builds.
    partial_summary = summary_path.with_suffix(".json.partial")
    partial_summary.write_text(json.dumps(summary, indent=2))
    partial_summary.replace(summary_path)
    log(f"{len(built)} variants built, {len(failed)} failed, {seconds['total (this run)']:.0f} s: {kit}")
    print(kit)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
