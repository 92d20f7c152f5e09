"""Our GGUF header reader against the `gguf` package's: the same metadata and the same tensor bytes, read from
the packaged SmolLM2 file and from a file the package writes; a damaged file is a clear error, not a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from hetnode.errors import ConfigError
from hetnode.models.gguf_file import dequantize, open_gguf
from hetnode.models.gguf_header import GGUFFormatError, GGUFHeader
from hetnode.models.resolve import resolve_model


def same_as_the_package(path: Path) -> None:
    ours, theirs = GGUFHeader(path), GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(want)
    for key, value in want.items():
        got: Any = ours.fields[key]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_the_packaged_smollm2_file_reads_as_the_package_reads_it() -> None:
    same_as_the_package(resolve_model("smollm2-135m"))


def written(path: Path, *, alignment: int | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_string("general.name", "tiny tést")
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<s>"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 0.0])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_float32("llama.rope.freq_base", 10000.0)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q = quantize(rng.standard_normal((8, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    w.add_tensor("blk.0.ffn_up.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_the_package_reads_it(tmp_path: Path, alignment: int | None) -> None:
    same_as_the_package(written(tmp_path / "tiny.gguf", alignment=alignment))


def test_a_damaged_file_is_a_clear_error(tmp_path: Path) -> None:
    good = written(tmp_path / "tiny.gguf").read_bytes()
    cases = {"not-gguf": b"GGML" + good[4:], "cut-header": good[:40], "cut-data": good[:-16], "empty": b""}
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises((GGUFFormatError, ValueError)):
            GGUFHeader(path)
        with pytest.raises(ConfigError, match="cannot read GGUF file"):
            open_gguf(path)


def test_dequantized_values_are_the_packages() -> None:
    """Our chunked dequantization (many rows per numpy call) gives gguf.quants' values exactly, for every tensor
    type the packaged file holds (Q4_1, Q8_0, F32) and for one written in Q4_0."""
    header = GGUFHeader(resolve_model("smollm2-135m"))
    tensors = list(header.tensors)
    q4_0 = quantize(np.random.default_rng(1).standard_normal((40, 96)).astype(np.float32), GGMLQuantizationType.Q4_0)
    seen = {t.tensor_type for t in tensors}
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32} <= seen
    for data, qtype in [*((t.data, t.tensor_type) for t in tensors), (q4_0, GGMLQuantizationType.Q4_0)]:
        ours, theirs = dequantize(data, qtype), np.asarray(gguf_dequantize(data, qtype), dtype=np.float32)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape and np.array_equal(ours, theirs)
