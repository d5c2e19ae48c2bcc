"""/v1/embeddings bodies (no model): inputs in each shape, the bounds, dimensions, the model's own
pooling config, and the answer's shape."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from services.gateway.limits import RequestLimits
from services.gateway.openai.embeddings import embeddings_body, model_pooling, parse_embeddings, vector_of
from services.gateway.openai.errors import ApiError

NAMES = {"m"}
LIMITS = RequestLimits(max_embedding_inputs=3)


def parse(body):
    return parse_embeddings(body, NAMES, 64, LIMITS)


def test_every_input_shape():
    assert parse({"input": "a"}).inputs == [("a", None)]
    assert parse({"input": ["a", "b"]}).inputs == [("a", None), ("b", None)]
    assert parse({"input": [1, 2]}).inputs == [(None, [1, 2])]
    assert parse({"input": [[1], [2, 3]], "model": "m", "user": "u"}).inputs == [(None, [1]), (None, [2, 3])]
    r = parse({"input": "a", "encoding_format": "base64", "dimensions": 8})
    assert (r.encoding_format, r.dimensions) == ("base64", 8)
    (g,) = r.to_generates("id", "last")
    assert g.params.pooling == "last" and g.params.max_tokens == 1 and g.request_id == "id-0"


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[1], []]}, "input"), ({"input": [["a"]]}, "input"), ({"input": 5}, "input"),
    ({"input": ["a"] * 4}, "input"), ({"input": "a", "dimensions": 65}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"), ({"input": "a", "user": 3}, "user"),
])
def test_bad_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse({"input": "a", "model": "other"})
    assert info.value.status == 404


def test_dimensions_cut_and_renormalise_and_base64_is_little_endian_float32():
    v = np.array([0.6, 0.8, 0.0, 0.0], dtype="<f4").tobytes()
    np.testing.assert_allclose(vector_of(v, 1), [1.0])
    np.testing.assert_allclose(vector_of(v, None), [0.6, 0.8, 0, 0], rtol=1e-6)
    body = embeddings_body([vector_of(v, 2)], 7, "m", "base64")
    assert np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4").tolist() == pytest.approx([0.6, 0.8])
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and body["object"] == "list"


def test_the_models_own_pooling_config(tmp_path):
    assert model_pooling(tmp_path) is None  # a causal LM: the server's default (mean)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                     "pooling_mode_mean_tokens": False}))
    assert model_pooling(tmp_path) == "cls"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert model_pooling(tmp_path) == "last"
