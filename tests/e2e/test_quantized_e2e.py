"""The chain on the bundled model written as msModelSlim W8A8_DYNAMIC by the
quantize command: the worker says which weights it loaded, the scheduler's
greedy tokens are the in-process runner's on the same checkpoint (whose
numbers tests/unit/worker/test_quantized_checkpoints.py holds to the format's
math), and the openai client gets an answer. A checkpoint in a format the
worker does not serve stops it at start with one line naming the format."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from services.common.model_files import default_model_path, resolve_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform
from services.worker.sequence import SamplingParams, SequenceInput
from stormserve.scheduler.v1 import scheduler_pb2
from tests.e2e.conftest import running_chain

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(["gen", "."])}


@pytest.fixture(scope="module")
def w8a8_chain(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("smollm2-w8a8") / "model"
    subprocess.run([sys.executable, "-m", "services.worker.quantize", "default", str(model_dir),
                    "--format", "w8a8_dynamic"], check=True, env=ENV, timeout=600)
    logs = tmp_path_factory.mktemp("w8a8-chain")
    env = {"STORMSERVE_MODEL_PATH": str(model_dir), "STORMSERVE_MODEL_NAME": "smollm2-w8a8",
           "STORMSERVE_KV_CACHE_MIB": "64"}
    with running_chain(logs, env=env) as (chain, stub):
        yield model_dir, chain, stub, logs


def test_the_worker_serves_the_checkpoints_int8_weights(w8a8_chain):
    model_dir, _, stub, logs = w8a8_chain
    assert "msModelSlim W8A8_DYNAMIC weights, lean path" in (logs / "worker0.log").read_text()
    prompt = list(range(1000, 1024))
    platform = CpuPlatform(torch.device("cpu"))
    platform.set_activations("auto")
    runner = ModelRunner(model_dir, platform, platform.resolve_dtype("auto"), 16, 64 * 2**20, 4)
    greedy = SamplingParams(temperature=0.0)
    expected = [runner.step([SequenceInput(1, prompt, 0, True, greedy, list(range(4)))]).tokens[0].token_id]
    while len(expected) < 12:
        step = SequenceInput(1, [expected[-1]], len(prompt) + len(expected) - 1, True, None, list(range(4)))
        expected.append(runner.step([step]).tokens[0].token_id)
    request = scheduler_pb2.GenerateRequest(
        request_id="w8a8-greedy", prompt_token_ids=prompt, sampling=scheduler_pb2.SamplingParams(temperature=0.0),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True))
    assert [t.token_id for reply in stub.Generate(request, timeout=120) for t in reply.tokens] == expected


def test_the_openai_client_gets_an_answer(w8a8_chain):
    from openai import OpenAI

    _, chain, _, _ = w8a8_chain
    client = OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(model="smollm2-w8a8", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert "4" in reply.choices[0].message.content  # as the bfloat16 model answers


def test_a_format_not_served_stops_the_worker_with_its_name(tmp_path):
    source = resolve_model(default_model_path())
    for path in source.iterdir():
        if path.is_file():
            shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "services.worker", "--port", "0"], capture_output=True, text=True,
                          env={**ENV, "STORMSERVE_MODEL_PATH": str(tmp_path)}, timeout=300)
    assert done.returncode == 2
    assert "CRITICAL" in done.stderr and "quant_method bitsandbytes is not served" in done.stderr
    assert "Traceback" not in done.stderr
