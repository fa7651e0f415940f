"""Quantized checkpoints in every format the worker reads, made at test time
from tiny float models (tests/quantized_models.py, the compressed-tensors
package, our quantize command): the worker's logits equal transformers' eager
float32 forward over the float weights each format's tensors stand for, at every
step of a packed, chunked, cached schedule. Formats or tensors the worker
cannot serve are refused when the model loads, by name."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from services.common.model_files import default_model_path, resolve_model

from services.worker import int8_kernels, quant_formats, quantization
from services.worker.decoder import LeanDecoder
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.quantize import main as quantize_main
from tests import quantized_models
from tests.moe_models import reference_model as moe_reference, stack_experts
from tests.unit.worker.block_tables import assert_schedule_matches

VOCAB = 256


def _llama(vocab_size: int, seed: int = 0):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = _llama(VOCAB)
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """With the bundled tokenizer (and its vocabulary): W8A8 static calibrates on texts."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    model = _llama(len(tokenizer))
    directory = tmp_path_factory.mktemp("llama-tokenizer")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, directory


def _runner(directory):
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=8)
    assert isinstance(runner.decoder, LeanDecoder)
    return runner


def _reference(model, weights: dict[str, torch.Tensor]):
    reference = type(model)(model.config).eval()
    reference.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return reference


def _quantize_activations(reference, static: dict[str, tuple[float, float] | None]) -> None:
    """Make each of the reference's linears named in `static` see its input as
    int8 activations do (the W8A8 formats' math, which the worker's integer
    kernels run): per token, round(x / s) · s with s = max |x| / 127 (None), or
    per tensor, (round(x / scale + offset) − offset) · scale ((scale, offset))."""
    modules = dict(reference.named_modules())

    def hook(quant):
        def quantize(_module, args):
            x = args[0]
            if quant is None:
                return (_dynamic_int8(x),)
            scale, offset = quant
            return (((x / scale + offset).round().clamp(-128, 127) - offset) * scale,)
        return quantize

    for name, quant in static.items():
        modules[name].register_forward_pre_hook(hook(quant))


def _dynamic_int8(x: torch.Tensor) -> torch.Tensor:
    """Each row as per-token int8 activations see it: round(x / s) · s, s = max |x| / 127."""
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    return (x / s).round().clamp(-127, 127) * s


def _quantize_expert_activations(model) -> None:
    """transformers' experts loop (Qwen3MoeExperts.forward) with each expert's
    inputs, gate_up's and down's, rounded as W8A8_DYNAMIC's per-token int8."""
    import types

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, position = torch.where(top_k_index == expert)
            if not len(token):
                continue
            gate, up = F.linear(_dynamic_int8(hidden_states[token]), self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(_dynamic_int8(self.act_fn(gate) * up), self.down_proj[expert])
            out.index_add_(0, token, y * top_k_weights[token, position, None])
        return out

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.forward = types.MethodType(forward, module)


def _int8_linears(directory) -> dict[str, tuple[float, float] | None]:
    """The linears of a W8A8 checkpoint that the worker runs on int8 kernels
    outside the experts (_quantize_expert_activations takes those), with their
    static input quantization or None (dynamic)."""
    stored = load_file(directory / "model.safetensors")
    linears = {}
    for name, tensor in stored.items():
        if name.endswith(".weight") and tensor.dtype == torch.int8 and ".experts." not in name:
            prefix = name.removesuffix(".weight")
            static = None
            if prefix + ".input_scale" in stored:
                static = (float(stored[prefix + ".input_scale"]), float(stored[prefix + ".input_offset"]))
            linears[prefix] = static
    return linears


def _assert_matches(reference, runner, vocab: int = VOCAB) -> None:
    generator = torch.Generator().manual_seed(1)
    tokens = {1: torch.randint(0, vocab, (23,), generator=generator).tolist(),
              2: torch.randint(0, vocab, (15,), generator=generator).tolist()}
    with torch.inference_mode():
        expected = {s: reference(torch.tensor([t])).logits[0] for s, t in tokens.items()}
    assert_schedule_matches(runner, expected, tokens)
    for seq_id in tokens:
        runner.release(seq_id)


WRITERS = {
    "awq": lambda state: quantized_models.awq(state, 128),
    "gptq": lambda state: quantized_models.gptq(state, 128),
    "gptq-act-order": lambda state: quantized_models.gptq(state, 32, act_order=True),
    "fp8-blocks": lambda state: quantized_models.fp8_blocks(state, 128),
    "compressed-tensors-int4": lambda state: quantized_models.compressed_tensors(state, "int4"),
    "compressed-tensors-int8": lambda state: quantized_models.compressed_tensors(state, "int8"),
    "compressed-tensors-fp8": lambda state: quantized_models.compressed_tensors(state, "fp8"),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_hf_formats_serve_their_float_weights(llama, fmt, tmp_path):
    model, source = llama
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stored, weights, config = WRITERS[fmt](state)
    directory = quantized_models.write(tmp_path / fmt, source, stored, quantization=config)
    assert any(not torch.equal(weights[k], model.state_dict()[k]) for k in weights)  # quantization changed them
    reference = _reference(model, weights)
    if fmt == "compressed-tensors-int8":  # W8A8, dynamic per-token activations
        _quantize_activations(reference, _int8_linears(directory))
    _assert_matches(reference, _runner(directory))


def test_modelslim_w4a16(llama, tmp_path):
    model, source = llama
    stored, weights, description = quantized_models.modelslim_w4a16(dict(model.state_dict()))
    directory = quantized_models.write(tmp_path / "w4a16", source, stored, description=description)
    _assert_matches(_reference(model, weights), _runner(directory))


def _modelslim_float_weights(directory) -> dict[str, torch.Tensor]:
    """The float weights an msModelSlim checkpoint's tensors stand for, read
    from the file as msModelSlim defines them: W8A8_DYNAMIC weight · weight_scale;
    W8A8 weight · deq_scale / input_scale, and a bias of
    (quant_bias + input_offset · Σ weight) · deq_scale."""
    stored = load_file(directory / "model.safetensors")
    description = json.loads((directory / "quant_model_description.json").read_text())
    weights = {}
    for name, tensor in stored.items():
        kind = description[name]
        if kind == "FLOAT":
            weights[name] = tensor.float()
        elif name.endswith(".weight"):
            prefix = name.removesuffix(".weight")
            if kind == "W8A8_DYNAMIC":
                weights[name] = tensor.float() * stored[prefix + ".weight_scale"].float()
            else:
                deq = stored[prefix + ".deq_scale"].float()
                weights[name] = tensor.float() * (deq / stored[prefix + ".input_scale"].float())[:, None]
                bias = (stored[prefix + ".quant_bias"].double() + stored[prefix + ".input_offset"].double()
                        * tensor.double().sum(1)) * deq.double()
                assert bias.abs().max() < 1e-6  # the tiny Llama has no biases
    return weights


@pytest.mark.parametrize("fmt", ["w8a8_dynamic", "w8a8"])
def test_quantize_command_writes_modelslim(llama_with_tokenizer, fmt, tmp_path):
    model, source = llama_with_tokenizer
    directory = tmp_path / fmt
    assert quantize_main([str(source), str(directory), "--format", fmt]) == 0
    description = json.loads((directory / "quant_model_description.json").read_text())
    assert description["model_quant_type"] == fmt.upper()
    assert description["model.layers.0.self_attn.q_proj.weight"] == fmt.upper()
    assert description["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"  # dynamic in both
    assert description["lm_head.weight"] == description["model.embed_tokens.weight"] == "FLOAT"
    stored = load_file(directory / "model.safetensors")
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.int8
    if fmt == "w8a8":  # calibrated: Q, K and V see one input, so one scale
        scales = {float(stored[f"model.layers.0.self_attn.{p}_proj.input_scale"]) for p in "qkv"}
        assert len(scales) == 1 and scales.pop() > 0
    reference = _reference(model, _modelslim_float_weights(directory))
    _quantize_activations(reference, _int8_linears(directory))
    runner = _runner(directory)
    if int8_kernels.int8_linear_available():  # the integer kernels, not a dequantized weight
        layer = runner.decoder.layers[0]
        assert isinstance(layer.attention.qkv, int8_kernels.QuantizedLinear)
        assert isinstance(layer.mlp.gate_up, int8_kernels.QuantizedLinear)
    _assert_matches(reference, runner)


def test_deepseek_v3_fp8_blocks_mla_and_experts(tmp_path):
    """DeepSeek's own format on its own family: every projection of MLA and of the
    experts in FP8 blocks (partial blocks at the edges)."""
    model = moe_reference("deepseek_v3", VOCAB)
    source = tmp_path / "float"
    model.save_pretrained(source)
    stored, weights, config = quantized_models.fp8_blocks(load_file(source / "model.safetensors"), block=32)
    assert any(n.endswith("kv_b_proj.weight_scale_inv") for n in stored)
    assert any(".experts.3." in n and n.endswith("weight_scale_inv") for n in stored)
    directory = quantized_models.write(tmp_path / "fp8", source, stored, quantization=config)
    model.load_state_dict(stack_experts(weights), strict=True)
    _assert_matches(model, _runner(directory))


def test_qwen3_moe_w8a8_dynamic_experts(tmp_path):
    model = moe_reference("qwen3_moe", VOCAB)
    source = tmp_path / "float"
    model.save_pretrained(source)
    directory = tmp_path / "w8a8"
    # No tokenizer to calibrate with: no smoothing.
    assert quantize_main([str(source), str(directory), "--format", "w8a8_dynamic", "--smooth-alpha", "-1"]) == 0
    description = json.loads((directory / "quant_model_description.json").read_text())
    assert description["model.layers.1.mlp.experts.5.up_proj.weight"] == "W8A8_DYNAMIC"
    assert description["model.layers.1.mlp.gate.weight"] == "FLOAT"  # the router stays float
    model.load_state_dict(stack_experts(_modelslim_float_weights(directory)), strict=True)
    _quantize_activations(model, _int8_linears(directory))
    _quantize_expert_activations(model)
    runner = _runner(directory)
    experts = runner.decoder.layers[1].mlp.moe.experts
    if int8_kernels.int8_linear_available():  # each expert on the integer kernels, as stored
        assert all(isinstance(linear, int8_kernels.QuantizedLinear) for linear in experts.gate_up + experts.down)
    _assert_matches(model, runner)


# --- refusals -------------------------------------------------------------------


def _refused(directory, *words) -> None:
    with pytest.raises(quantization.UnsupportedQuantization) as refused:
        _runner(directory)
    for word in words:
        assert word in str(refused.value)


def test_unknown_quant_method_is_refused(llama, tmp_path):
    model, source = llama
    directory = quantized_models.write(tmp_path / "bnb", source, dict(model.state_dict()),
                                       quantization={"quant_method": "bitsandbytes", "load_in_4bit": True})
    _refused(directory, "bitsandbytes")


def test_unknown_modelslim_type_is_refused_naming_the_tensor(llama, tmp_path):
    model, source = llama
    state = dict(model.state_dict())
    description = {name: "FLOAT" for name in state}
    description["model.layers.1.mlp.up_proj.weight"] = "W4A8_DYNAMIC"
    directory = quantized_models.write(tmp_path / "w4a8", source, state, description=description)
    _refused(directory, "model.layers.1.mlp.up_proj.weight", "W4A8_DYNAMIC")


def test_modelslim_kv_cache_quantization_is_refused(llama, tmp_path):
    model, source = llama
    state = dict(model.state_dict())
    description = {**{name: "FLOAT" for name in state}, "kv_cache_type": "C8"}
    _refused(quantized_models.write(tmp_path / "c8", source, state, description=description), "kv_cache_type", "C8")


def test_asymmetric_compressed_tensors_weights_are_refused(llama, tmp_path):
    model, source = llama
    stored, _, config = quantized_models.compressed_tensors(dict(model.state_dict()), "int4")
    stored["model.layers.0.self_attn.o_proj.weight_zero_point"] = torch.ones(128, 4, dtype=torch.int8)
    directory = quantized_models.write(tmp_path / "asym", source, stored, quantization=config)
    _refused(directory, "model.layers.0.self_attn.o_proj.weight", "weight_zero_point")


def test_quantized_checkpoint_of_a_family_off_the_lean_path_is_refused(llama, tmp_path):
    """transformers would load msModelSlim's int8 tensors as floats without a word."""
    model, source = llama
    directory = tmp_path / "w8a8"
    assert quantize_main([str(source), str(directory), "--format", "w8a8_dynamic", "--smooth-alpha", "-1"]) == 0
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))  # not the lean path's
    _refused(directory, "LlamaForCausalLM", "msModelSlim W8A8_DYNAMIC")


def test_smoothing_keeps_the_float_models_function(llama_with_tokenizer):
    """SmoothQuant divides inputs by s and multiplies weight columns by s, folding
    the division into the norms, V and up: the float model computes the same
    logits, while the largest input channel shrinks."""
    from services.worker.quantize import smooth

    model, _ = llama_with_tokenizer
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    generator = torch.Generator().manual_seed(3)
    ranges = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            high = torch.rand(w.shape[1], generator=generator) * 10 + 0.1
            high[5] = 300.0  # an outlier channel
            ranges[name.removesuffix(".weight")] = (-high, high)
    before = float(ranges["model.layers.0.self_attn.q_proj"][1].max())
    assert smooth(weights, ranges, config, 0.5) == 2
    assert float(ranges["model.layers.0.self_attn.q_proj"][1].max()) < before / 10
    smoothed = type(model)(model.config).eval()
    smoothed.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 1000, (1, 17), generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(smoothed(ids).logits, model(ids).logits, atol=2e-4, rtol=2e-4)


# --- pieces -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_words_unpack_lowest_bits_first(bits):
    values = torch.randint(0, 2**bits, (16, 64), dtype=torch.int32)
    packed = quantized_models._words(values, bits)  # [16, 64 · bits / 32]
    assert torch.equal(quant_formats.unpack_int32(packed, bits, 1), values)
    assert torch.equal(quant_formats.unpack_int32(packed.t().contiguous(), bits, 0), values.t())


def test_four_bit_groups_of_128_are_four_groups_of_32():
    q = torch.randint(0, 16, (16, 256))
    scale, zero = torch.rand(16, 2) + 0.1, torch.randint(0, 16, (16, 2)).float()
    grouped = quant_formats._grouped(q, scale, zero, 128)
    assert isinstance(grouped, quantization.FourBitWeight) and grouped.scale.shape == (16, 8)
    expected = (q.float() - zero.repeat_interleave(128, 1)) * scale.repeat_interleave(128, 1)
    torch.testing.assert_close(grouped.dequantize(), expected)
