"""Write an msModelSlim W8A8_DYNAMIC or W8A8 (static) checkpoint from any model
the worker loads (an HF directory, a GGUF file, or `default`, the bundled model):

    python -m services.worker.quantize default /tmp/smollm2-w8a8 --format w8a8_dynamic
    python -m services.worker.quantize ./my-model ./my-model-w8a8 --format w8a8

The linears of the decoder layers (every `*_proj` of attention, MLP and
experts) become int8 with a scale per output row (symmetric, round to nearest);
embeddings, norms, routers, lm_head and DeepSeek's MTP module stay as they
are, as msModelSlim leaves them. W8A8 static also calibrates each linear's
input range over fixed texts (CALIBRATION, or --calibration-file) in float32
and stores msModelSlim's per-tensor input_scale / input_offset, deq_scale and
quant_bias. quant_model_description.json names each tensor's type, and every
other file of the model (config, tokenizer, templates) is copied beside.
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
from services.worker.quantization import DESCRIPTION_FILE

log = logging.getLogger("services.worker.quantize")

FORMATS = ("w8a8_dynamic", "w8a8")
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


def input_ranges(model_dir: Path, prefixes: list[str], texts: list[str]) -> dict[str, tuple[float, float]]:
    """Each linear's smallest and largest input value over `texts`, through the
    model in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranges: dict[str, tuple[float, float]] = {}
    modules = dict(model.named_modules())

    def record(prefix):
        def hook(_module, args):
            x = args[0].detach()
            low, high = ranges.get(prefix, (0.0, 0.0))  # the range holds zero: padding and offsets stay exact
            ranges[prefix] = (min(low, float(x.min())), max(high, float(x.max())))
        return hook

    missing = [p for p in prefixes if p not in modules]
    if missing:
        raise ValueError(f"calibration: the model has no module {missing[0]} (transformers' layout differs "
                         f"from the checkpoint's names); quantize with --format w8a8_dynamic")
    handles = [modules[p].register_forward_pre_hook(record(p)) for p in prefixes]
    with torch.inference_mode():
        for text in texts:
            model(**tokenizer(text, return_tensors="pt"))
    for handle in handles:
        handle.remove()
    return ranges


def quantize(source: str, out: Path, fmt: str, texts: list[str]) -> None:
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
    ranges = input_ranges(model_dir, [n.removesuffix(".weight") for n in linears], texts) if fmt == "w8a8" else {}
    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": kind, "version": "1.0.0"}
    for name in names:
        if name in linears:
            continue
        tensors[name] = checkpoint.stored(name).contiguous()
        description[name] = "FLOAT"
    for done, name in enumerate(linears, start=1):
        prefix = name.removesuffix(".weight")
        q, scale = int8_rows(checkpoint[name])
        parts = {"weight": q, "weight_scale": scale[:, None], "weight_offset": torch.zeros(q.shape[0], 1)}
        if fmt == "w8a8":
            low, high = ranges[prefix]
            input_scale = max(high - low, 1e-8) / 255
            input_offset = int(round(-128 - low / input_scale))
            deq_scale = scale * input_scale
            bias = checkpoint.get(prefix + ".bias")
            folded = torch.zeros(q.shape[0]) if bias is None else (bias.float() / deq_scale).round()
            quant_bias = folded.to(torch.int64) - input_offset * q.to(torch.int64).sum(1)
            parts |= {"input_scale": torch.tensor([input_scale]), "input_offset": torch.tensor([float(input_offset)]),
                      "deq_scale": deq_scale, "quant_bias": quant_bias.to(torch.int32)}
            if bias is not None:  # folded into quant_bias
                tensors.pop(prefix + ".bias", None)
                description.pop(prefix + ".bias", None)
        for part, tensor in parts.items():
            tensors[f"{prefix}.{part}"] = tensor.contiguous()
            description[f"{prefix}.{part}"] = kind
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
    parser.add_argument("--calibration-file", type=Path,
                        help="w8a8: texts to calibrate on, one per line (default: a fixed set)")
    args = parser.parse_args(argv)
    setup_logging("quantize")
    texts = list(CALIBRATION)
    if args.calibration_file is not None:
        texts = [line for line in args.calibration_file.read_text().splitlines() if line.strip()]
    try:
        quantize(args.model, args.out, args.format, texts)
    except (ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
