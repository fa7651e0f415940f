"""The quantized checkpoint formats quantization.py's layer reads: detecting
one from a model directory, reading each quantized linear of it as a weight
type of quantization.py, and refusing what cannot be served, naming the tensor
and the format."""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from services.worker.quantization import (GROUP, FourBitWeight, Fp8BlockWeight, Int8Weight, QuantizedWeight,
                                          UnsupportedQuantization, expand_blocks)

DESCRIPTION_FILE = "quant_model_description.json"

Reader = Callable[[str], torch.Tensor]  # a stored tensor by name, as stored


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits unsigned values each, lowest bits first,
    unpacked along `dim` of a 2-D tensor (int32 values)."""
    if dim == 0:
        return unpack_int32(packed.t(), bits, 1).t()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _grouped(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> FourBitWeight | torch.Tensor:
    """q [out, in] 0..15 with scale and zero [out, in / group_size]:
    weight = (q − zero) · scale. A FourBitWeight where the groups split into
    GROUP-sized ones, else the float weight."""
    scale, zero = scale.float(), zero.float()
    if group_size % GROUP == 0 and q.shape[1] % group_size == 0:
        repeat = group_size // GROUP
        scale, zero = scale.repeat_interleave(repeat, 1), zero.repeat_interleave(repeat, 1)
        return FourBitWeight(q.to(torch.uint8).contiguous(), scale.contiguous(), (-zero * scale).contiguous())
    return ((q.float() - zero.repeat_interleave(group_size, 1)) * scale.repeat_interleave(group_size, 1))


def _by_index(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Act-order: input i of q [out, in] is in group g_idx[i]."""
    g = g_idx.long()
    return (q.float() - zero.float()[:, g]) * scale.float()[:, g]


# --- formats ------------------------------------------------------------------


class Scheme:
    """One checkpoint's format: which linears it quantizes and how each is read."""

    name: str

    def __init__(self, names: Iterable[str]):
        self.linears: set[str] = self._linears(set(names))

    def _linears(self, names: set[str]) -> set[str]:
        raise NotImplementedError

    def load(self, prefix: str, read: Reader, has: Callable[[str], bool]) -> torch.Tensor | QuantizedWeight:
        raise NotImplementedError

    def bias(self, prefix: str, read: Reader, has: Callable[[str], bool]) -> torch.Tensor | None:
        """A bias the format folds into its quantized tensors (msModelSlim's static W8A8)."""
        return None

    def refuse(self, prefix: str, why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(f"{prefix}.weight: {why} ({self.name} checkpoint); this is not served, "
                                       f"rather than served wrong")


def _with_suffix(names: set[str], suffix: str) -> set[str]:
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}


class ModelSlim(Scheme):
    """msModelSlim (quant_model_description.json: each tensor's type), as
    vllm-ascend reads it:
    - W8A8: weight int8 [out, in], input_scale and input_offset [1], deq_scale
      [out] (float32; int64 holding float32 bits for float16 models),
      quant_bias int32 [out], weight_scale / weight_offset [out, 1];
    - W8A8_DYNAMIC: weight int8 with weight_scale / weight_offset [out, 1];
    - W4A16: weight_packed int32 [out, in / 8] (values + 8), weight_scale and
      weight_offset [out, in / group_size]."""

    name = "msModelSlim"
    TYPES = ("W8A8", "W8A8_DYNAMIC", "W4A16")
    # Settings that quantize something other than a linear's weights.
    _OTHER_SETTINGS = ("kv_cache_type", "kv_quant_type", "fa_quant_type", "reduce_quant_type")

    def __init__(self, names: Iterable[str], description: dict):
        self.description = description
        self.group_size = int(description.get("group_size", 32) or 32)
        for key in self._OTHER_SETTINGS:
            value = description.get(key)
            if value not in (None, "", "FLOAT"):
                raise UnsupportedQuantization(f"{DESCRIPTION_FILE}: {key} {value}: a quantized KV cache or "
                                              f"attention is not served ({self.name} checkpoint)")
        super().__init__(names)

    def _linears(self, names: set[str]) -> set[str]:
        linears = set()
        for key, kind in self.description.items():
            if not isinstance(kind, str) or "." not in key or kind == "FLOAT":
                continue
            for suffix in (".weight", ".weight_packed"):
                if key.endswith(suffix):
                    prefix = key[: -len(suffix)]
                    if kind not in self.TYPES:
                        raise self.refuse(prefix, f"type {kind} is not one of {', '.join(self.TYPES)}")
                    linears.add(prefix)
        return linears

    def _kind(self, prefix: str) -> str:
        return self.description.get(prefix + ".weight") or self.description[prefix + ".weight_packed"]

    def _symmetric(self, prefix: str, read: Reader, has) -> None:
        if has(prefix + ".weight_offset") and bool(read(prefix + ".weight_offset").float().ne(0).any()):
            raise self.refuse(prefix, "non-zero weight_offset (asymmetric weights)")

    def load(self, prefix, read, has):
        kind = self._kind(prefix)
        if kind == "W4A16":
            self._symmetric(prefix, read, has)
            q = unpack_int32(read(prefix + ".weight_packed"), 4, 1)
            scale = read(prefix + ".weight_scale").float()
            return _grouped(q, scale, torch.full_like(scale, 8), q.shape[1] // scale.shape[1])
        q = read(prefix + ".weight")
        if q.dtype != torch.int8:
            raise self.refuse(prefix, f"{kind} weight stored as {q.dtype}, not int8")
        self._symmetric(prefix, read, has)
        if kind == "W8A8_DYNAMIC":
            return Int8Weight(q, read(prefix + ".weight_scale").float().flatten())
        input_scale = float(read(prefix + ".input_scale").float().flatten()[0])
        input_offset = int(read(prefix + ".input_offset").float().flatten()[0].round())
        return Int8Weight(q, self._deq_scale(prefix, read), (input_scale, input_offset))

    @staticmethod
    def _deq_scale(prefix: str, read: Reader) -> torch.Tensor:
        deq = read(prefix + ".deq_scale").flatten()
        if deq.dtype == torch.int64:  # float16 models: the float32's bits in an int64
            return deq.to(torch.int32).view(torch.float32)
        return deq.float()

    def bias(self, prefix, read, has):
        """Static W8A8 folds the float bias and the input offset's share into
        quant_bias = round(bias / deq_scale) − input_offset · Σ weight; the bias is
        what remains once the offset's share is taken back out."""
        if self._kind(prefix) != "W8A8":
            return None
        q = read(prefix + ".weight")
        offset = int(read(prefix + ".input_offset").float().flatten()[0].round())
        folded = read(prefix + ".quant_bias").to(torch.int64) + offset * q.to(torch.int64).sum(1)
        return None if not bool(folded.any()) else folded.float() * self._deq_scale(prefix, read)


class Fp8(Scheme):
    """FP8 e4m3 weights: DeepSeek-V3/R1's 128 × 128 blocks with a float32
    weight_scale_inv each (README_WEIGHTS.md), or a per-tensor / per-row
    weight_scale as other fp8 checkpoints write."""

    name = "fp8"

    def __init__(self, names: Iterable[str], config: dict):
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"quantization_config fp8 fmt {fmt}: only e4m3 is served")
        self.block = config.get("weight_block_size")
        super().__init__(names)

    def _linears(self, names):
        return {p for p in _with_suffix(names, ".weight_scale_inv") | _with_suffix(names, ".weight_scale")
                if p + ".weight" in names}

    def load(self, prefix, read, has):
        weight = read(prefix + ".weight")
        if weight.dtype != torch.float8_e4m3fn:
            raise self.refuse(prefix, f"weight stored as {weight.dtype}, not float8_e4m3fn")
        inverse = has(prefix + ".weight_scale_inv")
        scale = read(prefix + (".weight_scale_inv" if inverse else ".weight_scale")).float()
        refuse = functools.partial(self.refuse, prefix)
        if self.block and scale.dim() == 2 and scale.shape != (weight.shape[0], 1):
            if scale.shape != _block_grid(weight.shape, self.block):
                raise refuse(f"scale of shape {tuple(scale.shape)} does not fit a weight of {tuple(weight.shape)}")
            return Fp8BlockWeight(weight, scale, tuple(self.block))  # kept as stored, not expanded here
        return weight.float() * _broadcast_scale(scale, weight.shape, None, refuse)


def _block_grid(shape, block) -> tuple[int, int]:
    """How many blocks of `block` cover a weight of `shape` (the last ones partial)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _broadcast_scale(scale: torch.Tensor, shape, block, refuse) -> torch.Tensor:
    """A per-tensor, per-row or per-block scale expanded to the weight's shape."""
    rows, cols = shape
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == rows or scale.dim() == 1 and scale.numel() == rows:
        return scale.reshape(rows, 1)
    if scale.dim() == 2:
        block = block or (-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
        if scale.shape == _block_grid(shape, block):
            return expand_blocks(scale, shape, block)
    raise refuse(f"scale of shape {tuple(scale.shape)} does not fit a weight of {tuple(shape)}")


class Awq(Scheme):
    """AWQ (GEMM layout): qweight int32 [in, out / 8] and qzeros [in / group, out / 8],
    eight 4-bit values a word in the order 0 2 4 6 1 3 5 7, scales [in / group, out];
    weight = (q − zero) · scale."""

    name = "awq"
    # Column j of a word's eight sits in nibble ORDER_INVERSE[j].
    ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    ORDER_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)

    def __init__(self, names, config: dict):
        version = str(config.get("version", "gemm")).lower()
        if config.get("bits", 4) != 4 or version != "gemm" or not config.get("zero_point", True):
            raise UnsupportedQuantization(
                f"quantization_config awq bits {config.get('bits')} version {version} zero_point "
                f"{config.get('zero_point')}: only 4-bit GEMM with zero points is served")
        self.group_size = int(config.get("group_size", 128))
        super().__init__(names)

    def _linears(self, names):
        return _with_suffix(names, ".qweight")

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> torch.Tensor:
        """[rows, out / 8] words -> [out, rows] values."""
        values = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)[..., list(cls.ORDER_INVERSE)]
        return values.reshape(packed.shape[0], -1).t()

    def load(self, prefix, read, has):
        q, zero = self.unpack(read(prefix + ".qweight")), self.unpack(read(prefix + ".qzeros"))
        scale = read(prefix + ".scales").float().t()
        group_size = self.group_size if self.group_size > 0 else q.shape[1]
        return _grouped(q, scale, zero, group_size)


class Gptq(Scheme):
    """GPTQ: qweight int32 [in · bits / 32, out] packed along the inputs, qzeros
    [groups, out · bits / 32] (stored minus one in the original format,
    checkpoint_format "gptq"), scales [groups, out], g_idx [in] (the group of
    each input; act-order when not in order); weight = (q − zero) · scale."""

    name = "gptq"

    def __init__(self, names, config: dict):
        self.bits = int(config.get("bits", 4))
        form = config.get("checkpoint_format", "gptq")
        if self.bits not in (4, 8) or form not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"quantization_config gptq bits {self.bits} checkpoint_format {form}: "
                                          f"only 4 or 8 bits in the gptq or gptq_v2 layout are served")
        self.zero_plus_one = form == "gptq"
        self.group_size = int(config.get("group_size", 128))
        super().__init__(names)

    def _linears(self, names):
        return _with_suffix(names, ".qweight")

    def load(self, prefix, read, has):
        q = unpack_int32(read(prefix + ".qweight"), self.bits, 0).t()  # [out, in]
        zero = unpack_int32(read(prefix + ".qzeros"), self.bits, 1).t() + int(self.zero_plus_one)  # [out, groups]
        scale = read(prefix + ".scales").float().t()
        in_features = q.shape[1]
        group_size = self.group_size if self.group_size > 0 else in_features
        in_order = torch.arange(in_features) // group_size
        g_idx = read(prefix + ".g_idx").long() if has(prefix + ".g_idx") else in_order
        if self.bits == 4 and torch.equal(g_idx, in_order):
            return _grouped(q, scale, zero, group_size)
        return _by_index(q, scale, zero, g_idx)


class CompressedTensors(Scheme):
    """compressed-tensors (the `compressed-tensors` package's formats):
    - int-quantized: weight int8 [out, in] and weight_scale [out, 1];
    - pack-quantized: weight_packed int32 [out, in · bits / 32] (values +
      2^(bits−1)), weight_scale [out, in / group] or [out, 1], weight_shape,
      weight_g_idx for act-order;
    - float-quantized: weight float8_e4m3fn with weight_scale per tensor, row
      or block.
    Symmetric weights only (no weight_zero_point)."""

    name = "compressed-tensors"
    FORMATS = ("int-quantized", "pack-quantized", "float-quantized")

    def __init__(self, names, config: dict):
        if config.get("sparsity_config"):
            raise UnsupportedQuantization("compressed-tensors sparsity_config: sparse weights are not served")
        if config.get("kv_cache_scheme"):
            raise UnsupportedQuantization("compressed-tensors kv_cache_scheme: a quantized KV cache is not served")
        self.groups = list((config.get("config_groups") or {}).values())
        formats = {config.get("format")} | {g.get("format") for g in self.groups}
        for fmt in formats - {None}:
            if fmt not in self.FORMATS:
                raise UnsupportedQuantization(f"compressed-tensors format {fmt}: only {', '.join(self.FORMATS)} "
                                              f"are served")
        self.default_format = config.get("format")
        super().__init__(names)

    def _linears(self, names):
        return _with_suffix(names, ".weight_packed") | {p for p in _with_suffix(names, ".weight_scale")
                                                        if p + ".weight" in names}

    def _group(self, prefix: str) -> dict:
        """The config group whose targets name this linear (by the last part or a re: pattern)."""
        for group in self.groups:
            for target in group.get("targets", []):
                if target.startswith("re:") and re.search(target[3:], prefix) or prefix.endswith(target) \
                        or target == "Linear":
                    return group
        return self.groups[0] if self.groups else {}

    def load(self, prefix, read, has):
        if has(prefix + ".weight_zero_point"):
            raise self.refuse(prefix, "weight_zero_point (asymmetric weights)")
        group = self._group(prefix)
        weights = group.get("weights") or {}
        activations = group.get("input_activations")
        scale = read(prefix + ".weight_scale").float()
        if has(prefix + ".weight_packed"):
            bits = int(weights.get("num_bits", 4))
            shape = [int(v) for v in read(prefix + ".weight_shape").tolist()] if has(prefix + ".weight_shape") else None
            q = unpack_int32(read(prefix + ".weight_packed"), bits, 1)
            if shape is not None:
                q = q[: shape[0], : shape[1]]
            zero = torch.full_like(scale, 2 ** (bits - 1))
            if has(prefix + ".weight_g_idx"):
                return _by_index(q, scale, zero, read(prefix + ".weight_g_idx"))
            group_size = q.shape[1] // scale.shape[1]
            if bits == 4:
                return _grouped(q, scale, zero, group_size)
            return (q.float() - zero.repeat_interleave(group_size, 1)) * scale.repeat_interleave(group_size, 1)
        weight = read(prefix + ".weight")
        if weight.dtype == torch.float8_e4m3fn:
            block = weights.get("block_structure")
            return weight.float() * _broadcast_scale(scale, weight.shape, block, functools.partial(self.refuse, prefix))
        if weight.dtype != torch.int8:
            raise self.refuse(prefix, f"weight stored as {weight.dtype}")
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(weight.shape[0])
        elif scale.shape[-1] != 1:
            return weight.float() * _broadcast_scale(scale, weight.shape, None, functools.partial(self.refuse, prefix))
        scale = scale.flatten().contiguous()
        if activations and activations.get("type", "int") == "int" and activations.get("dynamic", False):
            return Int8Weight(weight, scale)
        return weight.float() * scale[:, None]


_METHODS = {"fp8": Fp8, "awq": Awq, "gptq": Gptq, "compressed-tensors": CompressedTensors}


def detect(model_dir: Path, names: Iterable[str]) -> Scheme | None:
    """The format of the checkpoint in `model_dir` whose tensors are `names`,
    or None for a float checkpoint; UnsupportedQuantization for one not served."""
    description = model_dir / DESCRIPTION_FILE
    if description.exists():
        return ModelSlim(names, json.loads(description.read_text()))
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quantization:
        return None
    method = str(quantization.get("quant_method", "")).lower()
    if method not in _METHODS:
        raise UnsupportedQuantization(f"quantization_config quant_method {method or '(none)'} is not served; "
                                      f"served: msModelSlim W8A8/W8A8_DYNAMIC/W4A16, {', '.join(_METHODS)}")
    return _METHODS[method](names, quantization)


def describe(model_dir: Path) -> str | None:
    """A short name of the checkpoint's format, for messages, or None for a float one."""
    description = model_dir / DESCRIPTION_FILE
    if description.exists():
        kind = json.loads(description.read_text()).get("model_quant_type", "")
        return f"msModelSlim {kind}".strip()
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    quantization = config.get("quantization_config")
    return None if not quantization else str(quantization.get("quant_method", "quantized"))
