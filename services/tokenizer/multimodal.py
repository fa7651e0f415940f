"""Images in front of a vision-language model: the model's own image processor
(the PIL one: no torchvision) turns each fetched image into the pixel tensor
its vision tower takes, and each placeholder the chat template wrote becomes
as many image tokens as the tower gives embeddings.

Families: LLaVA-style (a fixed-resolution tower: one token per patch, plus
the CLS token when the model keeps it) and Qwen2-VL / Qwen2.5-VL (dynamic
resolution: one token per merged patch of the image's own grid). Any other
model whose config has a vision tower is refused at start-up, not at the
first image.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import invalid_argument
from services.common.media_parts import MAX_STEP_IMAGE_BYTES, MROPE_MODEL_TYPES, VISION_MODEL_TYPES
from services.tokenizer.media import MediaItem, MediaRefused

@dataclass(frozen=True)
class ProcessedImage:
    """One image as the worker takes it (media.v1 ImageInput; server.py builds that)."""

    content_hash: bytes  # SHA-256 of the fetched bytes
    offset: int  # position of its first image token in the prompt
    num_tokens: int
    pixel_values: np.ndarray  # float32, C order
    grid_thw: tuple[int, int, int] | None  # Qwen2-VL's patch grid


class ImageProcessor:
    """The model's image processor and its placeholder expansion."""

    def __init__(self, model_dir: Path, model_config):
        from transformers import AutoImageProcessor

        if model_config.model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"vision-language model type {model_config.model_type!r} is not supported "
                             f"(supported: {', '.join(VISION_MODEL_TYPES)})")
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.is_dynamic = model_config.model_type in MROPE_MODEL_TYPES
        self.image_token_id: int = model_config.image_token_id
        vision = model_config.vision_config
        self.merge_size: int = getattr(vision, "spatial_merge_size", 1)
        self.patch_size: int = vision.patch_size
        # LLaVA's "default" strategy drops the tower's CLS embedding; "full" keeps it.
        self.num_extra_tokens = int(getattr(model_config, "vision_feature_select_strategy", "") == "full")

    def expand(self, token_ids: list[int], images: list[MediaItem]) -> tuple[list[int], list[ProcessedImage]]:
        """The prompt with the i-th image token replaced by the i-th image's
        tokens, and the images. Runs the processor: call it off the event loop."""
        positions = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(positions) != len(images):
            raise invalid_argument(f"the chat template wrote {len(positions)} image placeholders for "
                                   f"{len(images)} images")
        expanded: list[int] = []
        processed: list[ProcessedImage] = []
        start = num_bytes = 0
        for position, item in zip(positions, images):
            pixels, grid, num_tokens = self._process(item)
            num_bytes += pixels.nbytes
            if num_bytes > MAX_STEP_IMAGE_BYTES:
                raise MediaRefused(f"the images come to more than {MAX_STEP_IMAGE_BYTES // 2**20} MiB of pixels "
                                   "as the model's processor leaves them, the most one request may carry", 413,
                                   where="messages")
            expanded += token_ids[start:position]
            processed.append(ProcessedImage(bytes.fromhex(item.sha256), len(expanded), num_tokens, pixels, grid))
            expanded += [self.image_token_id] * num_tokens
            start = position + 1
        expanded += token_ids[start:]
        return expanded, processed

    def _process(self, item: MediaItem) -> tuple[np.ndarray, tuple[int, int, int] | None, int]:
        out = self.processor(images=[item.image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if self.is_dynamic:
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            return pixels, (t, h, w), t * h * w // self.merge_size ** 2
        pixels = pixels[0]  # [channels, height, width]
        num_tokens = (pixels.shape[1] // self.patch_size) * (pixels.shape[2] // self.patch_size)
        return pixels, None, num_tokens + self.num_extra_tokens
