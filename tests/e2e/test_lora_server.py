"""LoRA adapters through a real server and the openai SDK: an adapter given at start and one
loaded at run time answer as PEFT's merged model does, /v1/models lists them with their base,
load / unload / reload under load loses no request, and the bad inputs are OpenAI-style
errors (404 unknown adapter or path, 400 naming the rank, the base or the file)."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.helpers import ServerProcess, get, parse_metrics
from tests.lora_helpers import make_peft_adapter, merged_model

API_KEY = "lora-test-key"
PROMPT = [1, 504, 3081, 314, 253, 2194, 28, 9156, 30]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(tiny_model_dir, root / name, rank=rank, seed=seed, scale=3.0)
            for name, rank, seed in [("first", 8, 1), ("second", 4, 2), ("wide", 32, 3)]}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    extra = ["--dtype", "float32", "--quantization", "none", "--served-model-name", "tiny-llama",
             "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", f"first={adapters['first']}"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("run"), extra, api_key=API_KEY,
                       env={"PAGEDSERVE_API_KEY": API_KEY}) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict, key: str | None = API_KEY) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def complete(server, model: str) -> str:
    out = client(server).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def expected_text(base_dir, adapter_dir) -> str:
    hf = merged_model(base_dir, adapter_dir)
    with torch.no_grad():
        tokens = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)[0, len(PROMPT):]
    return AutoTokenizer.from_pretrained(base_dir).decode(tokens, skip_special_tokens=True)


def test_adapters_answer_as_peft_merged_models(server, tiny_model_dir, adapters):
    assert complete(server, "first") == expected_text(tiny_model_dir, adapters["first"])
    assert complete(server, "tiny-llama") == expected_text(tiny_model_dir, None)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(adapters["second"])})[0] == 200
    assert complete(server, "second") == expected_text(tiny_model_dir, adapters["second"])
    models = {m.id: m for m in client(server).models.list().data}
    assert models["first"].parent == "tiny-llama" and models["second"].parent == "tiny-llama"
    assert models["tiny-llama"].parent is None


def test_load_unload_reload_under_load(server, tiny_model_dir, adapters):
    want = {"first": expected_text(tiny_model_dir, adapters["first"]),
            "tiny-llama": expected_text(tiny_model_dir, None)}
    stop, errors, done = threading.Event(), [], []

    def hammer(model):
        while not stop.is_set():
            try:
                text = complete(server, model)
                done.append(model)
                if text != want[model]:
                    errors.append((model, text))
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                errors.append((model, repr(exc)))

    post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
    with ThreadPoolExecutor(4) as pool:
        for model in ["first", "tiny-llama", "first", "tiny-llama"]:
            pool.submit(hammer, model)
        for _ in range(3):  # a third adapter waits for one of the 2 slots while the others run
            assert post(server, "/v1/load_lora_adapter",
                        {"lora_name": "second", "lora_path": str(adapters["second"])})[0] == 200
            assert complete(server, "second") == expected_text(tiny_model_dir, adapters["second"])
            assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})[0] == 200
            with pytest.raises(openai.NotFoundError):
                complete(server, "second")
        stop.set()
    assert not errors, errors[:3]
    assert done.count("first") >= 2 and done.count("tiny-llama") >= 2
    metrics = parse_metrics(get(server.url + "/metrics", headers=server.headers)[1])
    assert any(k.startswith("vllm:lora_requests_info{") and 'max_lora="2"' in k for k in metrics)


def test_bad_adapters_are_refused(server, tiny_model_dir, adapters, tmp_path):
    with pytest.raises(openai.NotFoundError) as err:
        complete(server, "no-such-adapter")
    assert err.value.body["code"] == "model_not_found"

    def load(name, path, key=API_KEY):
        return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, key)

    assert load("x", adapters["first"], key=None)[0] == 401
    status, body = load("wide", adapters["wide"])
    assert status == 400 and "rank 32" in body and "--max-lora-rank 16" in body
    status, body = load("first", adapters["first"])
    assert status == 400 and "already been loaded" in body
    assert load("gone", tmp_path / "nothing")[0] == 404

    renamed = shutil.copytree(adapters["first"], tmp_path / "renamed")
    config = json.loads((renamed / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "other/model"}))
    status, body = load("renamed", renamed)
    assert status == 400 and "base_model_name_or_path" in json.loads(body)["error"]["message"]

    corrupt = shutil.copytree(adapters["first"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    status, body = load("corrupt", corrupt)
    assert status == 400 and "safetensors" in body

    other_dir = tmp_path / "other-base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=49152)).save_pretrained(other_dir)
    mismatched = make_peft_adapter(other_dir, tmp_path / "mismatched", rank=4)
    config = json.loads((mismatched / "adapter_config.json").read_text())
    (mismatched / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    status, body = load("mismatched", mismatched)
    assert status == 400 and "shape" in body

    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and "cannot be found" in body
    assert complete(server, "first")  # the server took none of it badly
