"""Write an msModelSlim W8A8_DYNAMIC or W8A8 (static) checkpoint from any model
the worker loads (an HF directory, a GGUF file, or `default`, the bundled model):

    python -m services.worker.quantize default /tmp/smollm2-w8a8 --format w8a8_dynamic
    python -m services.worker.quantize ./my-model ./my-model-w8a8 --format w8a8

The linears of the decoder layers (every `*_proj` of attention, MLP and
experts) become int8 with a scale per output row (symmetric, round to nearest);
embeddings, norms, routers, lm_head and DeepSeek's MTP module stay as they
are, as msModelSlim leaves them. First each linear's input range is measured
per channel over fixed texts (CALIBRATION, or --calibration-file) in float32,
and SmoothQuant moves the outlier channels' range into the weights (`smooth`;
the float model computes the same function). W8A8 static then stores
msModelSlim's per-tensor input_scale / input_offset, deq_scale and quant_bias
for each calibrated linear (down_proj and experts stay dynamic:
DYNAMIC_IN_STATIC). quant_model_description.json names each tensor's type, and
every other file of the model (config, tokenizer, templates) is copied beside.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.log import setup_logging
from services.common.model_files import default_model_path, resolve_model
from services.worker.checkpoint import Checkpoint
from services.worker.quant_formats import DESCRIPTION_FILE

log = logging.getLogger("services.worker.quantize")

FORMATS = ("w8a8_dynamic", "w8a8")
# W8A8 (static) keeps these linears' activations dynamic (per token), as
# msModelSlim's fallback does for its most sensitive layers: down_proj's input,
# SiLU(gate) · up, is heavy-tailed, and one calibrated scale per tensor rounds
# most of it to zero (the bundled model: perplexity +22.8 % with static
# down_proj, +2.1 % without; bench/quant_quality.py); experts' inputs are not
# calibrated one by one.
DYNAMIC_IN_STATIC = (".down_proj",)
# SmoothQuant's alpha by format, measured on the bundled model (perplexity
# against its bfloat16 run, bench/quant_quality.py): W8A8_DYNAMIC +4.6 % without
# smoothing, +0.04 % at 0.5; W8A8 static +2.1 % at 0.5, +1.3 % at 0.7, +3.5 % at 0.85.
SMOOTH_ALPHA = {"w8a8_dynamic": 0.5, "w8a8": 0.7}
_LINEAR = re.compile(r"^model\.layers\.(\d+)\..*_proj\.weight$")
CALIBRATION = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on its surface.",
    "Let x = 3 and y = 4. Then x^2 + y^2 = 25, so the hypotenuse of the right triangle is 5.",
    "Les modèles de langage prédisent le mot suivant. 言語モデルは次の単語を予測します。",
    '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}',
)


def quantized_names(names, num_hidden_layers: int) -> list[str]:
    """The linear weights msModelSlim quantizes: the decoder layers' *_proj,
    not an MTP module's (layers past num_hidden_layers)."""
    return sorted(n for n in names if (m := _LINEAR.match(n)) and int(m.group(1)) < num_hidden_layers)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q int8 [out, in], scale float32 [out])."""
    weight = weight.float()
    scale = weight.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def channel_ranges(model_dir: Path, prefixes: list[str], texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear's smallest and largest input per channel ([in] each) over
    `texts`, through the model in float32; the ranges hold zero."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    modules = dict(model.named_modules())

    def record(prefix):
        def hook(_module, args):
            x = args[0].detach().flatten(0, -2)
            if not x.shape[0]:
                return
            low, high = ranges.get(prefix, (torch.zeros(x.shape[-1]), torch.zeros(x.shape[-1])))
            ranges[prefix] = (torch.minimum(low, x.amin(0)), torch.maximum(high, x.amax(0)))
        return hook

    missing = [p for p in prefixes if p not in modules]
    if missing:
        raise ValueError(f"calibration: the model has no module {missing[0]} (transformers' layout differs "
                         f"from the checkpoint's names)")
    handles = [modules[p].register_forward_pre_hook(record(p)) for p in prefixes]
    with torch.inference_mode():
        for text in texts:
            model(**tokenizer(text, return_tensors="pt"))
    for handle in handles:
        handle.remove()
    if len(ranges) != len(prefixes):
        raise ValueError(f"calibration reached {len(ranges)} of {len(prefixes)} linears: does the model's "
                         f"tokenizer turn the texts into tokens?")
    return ranges


def smooth(weights: dict[str, torch.Tensor], ranges: dict, config: dict, alpha: float) -> int:
    """SmoothQuant (Xiao et al. 2023), as msModelSlim's anti-outlier step does it:
    a few input channels carry most of a small model's activation range, and one
    int8 scale per token then rounds every other channel coarsely. Each channel j
    of a linear's input is divided by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)
    and the linear's weight column multiplied by it, the division folded into
    what produces the input: the RMSNorm weight before Q/K/V and before gate/up
    of a dense MLP, the rows of V before o_proj (one scale per KV head's
    channel, the largest of the query heads that share it), the rows of up
    before down. The float model computes the same function; `weights` and
    `ranges` are changed in place. Returns the layers smoothed (those with
    Q/K/V and a dense MLP; MLA and experts are left as they are)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = 0

    def scales(prefix: str, columns: list[torch.Tensor]) -> torch.Tensor:
        low, high = ranges[prefix]
        x = torch.maximum(low.abs(), high.abs()).clamp(min=1e-5)
        w = torch.cat(columns).abs().amax(0).clamp(min=1e-5)
        return (x.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)

    def apply(readers: list[str], s: torch.Tensor) -> None:
        for reader in readers:  # the linears that read the input: columns times s
            weights[reader + ".weight"] = weights[reader + ".weight"] * s
            low, high = ranges[reader]
            ranges[reader] = (low / s, high / s)

    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        attention, mlp = layer + "self_attn.", layer + "mlp."
        if attention + "q_proj.weight" not in weights:
            continue
        qkv = [attention + p for p in ("q_proj", "k_proj", "v_proj")]
        s = scales(qkv[0], [weights[p + ".weight"] for p in qkv])
        weights[layer + "input_layernorm.weight"] = weights[layer + "input_layernorm.weight"] / s
        for p in qkv[1:]:
            ranges[p] = ranges[qkv[0]]
        apply(qkv, s)
        # o_proj's input channel (query head h, d) is V's (KV head h // group, d).
        s = scales(attention + "o_proj", [weights[attention + "o_proj.weight"]]).view(heads, head_dim)
        s = s.view(kv_heads, heads // kv_heads, head_dim).amax(1)  # [kv_heads, head_dim]
        v = attention + "v_proj"
        weights[v + ".weight"] = weights[v + ".weight"] / s.reshape(-1, 1)
        if v + ".bias" in weights:
            weights[v + ".bias"] = weights[v + ".bias"] / s.reshape(-1)
        apply([attention + "o_proj"], s.repeat_interleave(heads // kv_heads, 0).reshape(-1))
        if mlp + "gate_proj.weight" not in weights:  # an MoE layer: its router reads the norm too
            layers += 1
            continue
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        s = scales(gate_up[0], [weights[p + ".weight"] for p in gate_up])
        weights[layer + "post_attention_layernorm.weight"] = weights[layer + "post_attention_layernorm.weight"] / s
        ranges[gate_up[1]] = ranges[gate_up[0]]
        apply(gate_up, s)
        s = scales(mlp + "down_proj", [weights[mlp + "down_proj.weight"]])
        weights[mlp + "up_proj.weight"] = weights[mlp + "up_proj.weight"] / s[:, None]
        apply([mlp + "down_proj"], s)
        layers += 1
    return layers


def quantize(source: str, out: Path, fmt: str, texts: list[str], alpha: float | None) -> None:
    """`alpha`: SmoothQuant's migration strength (see smooth), None for none."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt}: one of {', '.join(FORMATS)}")
    model_dir = resolve_model(default_model_path() if source == "default" else source)
    checkpoint = Checkpoint(model_dir, torch.float32, torch.device("cpu"))
    if checkpoint.scheme is not None:
        raise ValueError(f"{model_dir} is already a {checkpoint.scheme.name} checkpoint")
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    names = checkpoint.names
    linears = quantized_names(names, int(config["num_hidden_layers"]))
    kind = fmt.upper()
    ranges: dict = {}
    static: set[str] = set()
    if fmt == "w8a8" or alpha is not None:  # first: the calibration model is gone before the weights are read
        calibrated = [n.removesuffix(".weight") for n in linears if ".experts." not in n]
        static = {p for p in calibrated if fmt == "w8a8" and not p.endswith(DYNAMIC_IN_STATIC)}
        ranges = channel_ranges(model_dir, calibrated, texts)
    # Every tensor in float32 where smoothing may change it, else as stored.
    smoothable = {n for n in names if n in linears or "layernorm" in n or n.endswith("v_proj.bias")}
    weights = {name: checkpoint[name] if name in smoothable else checkpoint.stored(name) for name in names}
    if alpha is not None:
        log.info("smoothed %d layers (alpha %.2f)", smooth(weights, ranges, config, alpha), alpha)
    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": kind, "version": "1.0.0"}
    for name in names:
        if name in linears:
            continue
        tensor = weights[name]
        if name in smoothable:  # read in float32: back to the dtype the file holds it in
            tensor = tensor.to(checkpoint.stored(name).dtype)
        tensors[name] = tensor.contiguous()
        description[name] = "FLOAT"
    for done, name in enumerate(linears, start=1):
        prefix = name.removesuffix(".weight")
        q, scale = int8_rows(weights[name])
        parts = {"weight": q, "weight_scale": scale[:, None], "weight_offset": torch.zeros(q.shape[0], 1)}
        if prefix in static:
            low, high = float(ranges[prefix][0].min()), float(ranges[prefix][1].max())
            input_scale = max(high - low, 1e-8) / 255
            input_offset = int(round(-128 - low / input_scale))
            deq_scale = scale * input_scale
            bias = weights.get(prefix + ".bias")
            folded = torch.zeros(q.shape[0]) if bias is None else (bias.float() / deq_scale).round()
            quant_bias = folded.to(torch.int64) - input_offset * q.to(torch.int64).sum(1)
            parts |= {"input_scale": torch.tensor([input_scale]), "input_offset": torch.tensor([float(input_offset)]),
                      "deq_scale": deq_scale, "quant_bias": quant_bias.to(torch.int32)}
            if bias is not None:  # folded into quant_bias
                tensors.pop(prefix + ".bias", None)
                description.pop(prefix + ".bias", None)
        part_kind = "W8A8" if prefix in static else "W8A8_DYNAMIC"
        for part, tensor in parts.items():
            tensors[f"{prefix}.{part}"] = tensor.contiguous()
            description[f"{prefix}.{part}"] = part_kind
        if done % 50 == 0 or done == len(linears):
            log.info("quantized %d of %d linears", done, len(linears))
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2))
    log.info("wrote %s: %s, %d linears int8 (%s)", out, kind, len(linears), model_dir.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an HF directory, a .gguf file, or `default` (the bundled model)")
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--format", default="w8a8_dynamic", choices=FORMATS)
    parser.add_argument("--smooth-alpha", type=float,
                        help="SmoothQuant's migration strength in [0, 1] (default: 0.5 for w8a8_dynamic, 0.7 for "
                             "w8a8); a negative value turns smoothing off")
    parser.add_argument("--calibration-file", type=Path,
                        help="w8a8: texts to calibrate on, one per line (default: a fixed set)")
    args = parser.parse_args(argv)
    setup_logging("quantize")
    texts = list(CALIBRATION)
    if args.calibration_file is not None:
        texts = [line for line in args.calibration_file.read_text().splitlines() if line.strip()]
    try:
        alpha = SMOOTH_ALPHA[args.format] if args.smooth_alpha is None else args.smooth_alpha
        quantize(args.model, args.out, args.format, texts, alpha if alpha >= 0 else None)
    except (ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
