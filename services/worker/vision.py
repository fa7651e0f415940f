"""Vision-language models: the vision tower and projector at prefill, their
embeddings placed at the image placeholders, in the same packed, paged step
as every text sequence.

Two families, both through the HF modules of the loaded model (transformers'
AutoModelForImageTextToText): the vision tower runs with SDPA, the language
model with the worker's paged attention.
- LLaVA-style (a CLIP-like tower, a projector, any causal LM): plain positions.
- Qwen2-VL and Qwen2.5-VL (dynamic resolution): the tower takes the image's patches and
  patch grid; the language model uses multimodal rotary positions (M-RoPE),
  three per token (temporal, height, width). Text tokens after an image sit at
  an offset from their place in the sequence, decode tokens included; the
  offset follows from the images alone, so any chunk of any sequence gets its
  positions without the rest of the prompt (`mrope_positions`).

Chunked prefill may split an image across steps: the step that first reaches
one of its placeholders encodes the whole image and keeps the embeddings with
the sequence (SequenceImages) until a step has passed its last placeholder, so
the tower runs once per image, however the chunks fall. The images a step
reaches, across its sequences, go through the tower in one call. A prefix-cache hit
that covers an image skips it: its embeddings are never needed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Container, Sequence
from pathlib import Path

import torch

from services.common.errors import invalid_argument
from services.common.media_parts import MROPE_MODEL_TYPES, VISION_MODEL_TYPES
from services.worker import attention
from services.worker.platforms import Platform


@dataclass(frozen=True)
class ImageInput:
    """One image of a sequence, as the model's image processor left it."""

    offset: int  # position of its first placeholder token in the sequence
    num_tokens: int  # placeholders it fills
    pixel_values: torch.Tensor | None  # float32, the processor's shape; None when not sent (cached)
    grid_thw: tuple[int, int, int] | None  # Qwen2-VL's patch grid; None for fixed-resolution towers

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class SequenceImages:
    """A sequence's images, in position order, and the embeddings of those a
    prefill has reached but not yet passed. An image's pixels go once a step
    has passed it: a long decode holds its span and grid only."""

    images: list[ImageInput]
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [num_tokens, hidden]


def images_refusal(images: tuple[ImageInput, ...]) -> str | None:
    """Why a sequence's image spans cannot be served (out of order, overlapping,
    empty), for its client; None when they can."""
    end = 0
    for image in images:
        if image.offset < end or image.num_tokens < 1:
            return "images must be in position order, non-empty and not overlap"
        end = image.end
    return None


def mrope_positions(images: Sequence[ImageInput], start: int, count: int, merge_size: int) -> torch.Tensor:
    """Qwen2-VL's (temporal, height, width) positions of sequence positions
    [start, start + count): [3, count]. As transformers' get_rope_index: text
    tokens count on from the last position; an image's tokens sit on its
    merged patch grid from where the text reached; the text after it goes on
    from there plus the grid's larger side."""
    positions = torch.arange(start, start + count)
    out = positions.expand(3, -1).clone()
    shift, text_from = 0, 0  # text at position p sits at p + shift
    for image in images:
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        text = (positions >= text_from) & (positions < image.offset)
        out[:, text] += shift
        inside = (positions >= image.offset) & (positions < image.end)
        if inside.any():
            local = positions[inside] - image.offset
            base = image.offset + shift
            out[:, inside] = torch.stack((local // (h * w), local // w % h, local % w)) + base
        shift = image.offset + shift + max(h, w) - image.end
        text_from = image.end
    out[:, positions >= text_from] += shift
    return out


class VisionLanguageDecoder:
    """Logits for a packed step of a vision-language model; images of the
    sequences whose new tokens reach them are encoded and placed."""

    def __init__(self, config, model_dir: Path, dtype: torch.dtype, backend: Platform):
        from transformers import AutoModelForImageTextToText
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if config.model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"vision-language model type {config.model_type!r} is not supported "
                             f"(supported: {', '.join(VISION_MODEL_TYPES)})")
        # Paged attention for the language model only: the tower attends within one image.
        self.model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=dtype, device_map=str(backend.device),
            attn_implementation={"text_config": attention.register(), "vision_config": "sdpa", "": "sdpa"},
        ).eval()
        self.config = self.model.config
        self.device = backend.device
        self.image_token_id: int = self.config.image_token_id
        self.is_mrope = self.config.model_type in MROPE_MODEL_TYPES
        self.merge_size: int = getattr(self.config.vision_config, "spatial_merge_size", 1)
        self.embed_tokens = self.model.get_input_embeddings()
        self.language_model = self.model.model.language_model
        self.lm_head = self.model.lm_head
        vision = self.config.vision_config
        if self.is_mrope:  # one row per patch: channels x frames x patch x patch values
            self._patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        else:  # a fixed crop, in patches; the CLS embedding is dropped unless "full"
            size = _pair(vision.image_size)
            patch = _pair(vision.patch_size)
            self._pixel_shape = (vision.num_channels, *size)
            self._tokens_per_image = (size[0] // patch[0]) * (size[1] // patch[1]) + (
                self.config.vision_feature_select_strategy == "full")

    def image_refusal(self, image: ImageInput) -> str | None:
        """Why the tower cannot take `image` as its request sent it (pixels or a
        grid of another shape than the model's, placeholders other than the
        embeddings it gives), for the client; None if it can. Checked before the
        step, so that a bad image refuses its own sequence, not the step."""
        if self.is_mrope:
            if image.grid_thw is None or min(image.grid_thw) < 1:
                return "an image needs a grid_thw of 3 positive entries with this model"
            t, h, w = image.grid_thw
            if h % self.merge_size or w % self.merge_size:
                return f"an image's grid_thw height and width must be multiples of {self.merge_size}"
            if image.num_tokens != t * h * w // self.merge_size ** 2:
                return (f"an image of grid_thw {list(image.grid_thw)} fills {t * h * w // self.merge_size ** 2} "
                        f"placeholder tokens, not {image.num_tokens}")
            expected: tuple[int, ...] = (t * h * w, self._patch_values)
        else:
            if image.num_tokens != self._tokens_per_image:
                return f"an image fills {self._tokens_per_image} placeholder tokens, not {image.num_tokens}"
            expected = self._pixel_shape
        if image.pixel_values is not None and tuple(image.pixel_values.shape) != expected:
            return f"an image's pixel_shape is {list(image.pixel_values.shape)}, not {list(expected)}"
        return None

    def step_refusal(self, images: Sequence[ImageInput], embedded: Container[int], token_ids: list[int],
                     start: int) -> str | None:
        """Why a step that feeds `token_ids` from position `start` cannot place a
        sequence's images (an image reached without pixels, placeholders that are
        other tokens), for the client; None if it can. `embedded`: the indexes of
        the images whose embeddings the sequence holds."""
        end = start + len(token_ids)
        for index, image in enumerate(images):
            low, high = max(start, image.offset), min(end, image.end)
            if low >= high:
                continue
            if image.pixel_values is None and index not in embedded:
                return (f"the image at [{image.offset}, {image.end}) came without pixels to a step that computes "
                        "its tokens")
            if token_ids[low - start : high - start].count(self.image_token_id) != high - low:
                return (f"the image span [{image.offset}, {image.end}) holds tokens other than the image token "
                        f"{self.image_token_id}")
        return None

    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The vision tower and projector over images in one call: [num_tokens, hidden] each."""
        pixels = [image.pixel_values.to(self.device, self.model.dtype) for image in images]  # type: ignore[union-attr]
        if self.is_mrope:  # patches of every image back to back, told apart by their grids
            grids = torch.tensor([image.grid_thw for image in images], dtype=torch.long, device=self.device)
            features = list(self.model.model.get_image_features(torch.cat(pixels), grids).pooler_output)
        else:  # one crop size: a batch
            features = list(self.model.model.get_image_features(
                pixel_values=torch.stack(pixels), vision_feature_layer=self.config.vision_feature_layer,
                vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            ).pooler_output)
        for image, feature in zip(images, features):
            if feature.shape[0] != image.num_tokens:
                raise invalid_argument(
                    f"an image gives {feature.shape[0]} embeddings but has {image.num_tokens} placeholder tokens")
        return features

    def __call__(self, input_ids: torch.Tensor, step: attention.PagedStep, logit_rows: torch.Tensor,
                 sequences: list[tuple[SequenceImages | None, int, int]]) -> torch.Tensor:
        """`sequences`: per sequence of the step, in packed order, its images (None
        without), the position of its first new token and its new token count."""
        self._encode_reached(sequences)
        embeds = self.embed_tokens(input_ids)  # [T, hidden]
        mrope = [] if self.is_mrope else None
        row = 0
        for images, start, count in sequences:
            if images is not None:
                self._place(embeds, input_ids, row, images, start, count)
            if mrope is not None:
                mrope.append(mrope_positions(images.images if images else [], start, count, self.merge_size))
            row += count
        positions = step.positions[None] if mrope is None else torch.cat(mrope, dim=1)[:, None].to(self.device)
        hidden = self.language_model(
            inputs_embeds=embeds[None], position_ids=positions, use_cache=False, paged_step=step,
        ).last_hidden_state[0]
        return self.lm_head(hidden.index_select(0, logit_rows))

    def _encode_reached(self, sequences: list[tuple[SequenceImages | None, int, int]]) -> None:
        """Encode, in one tower call, every image the step's new tokens reach
        that its sequence does not hold the embeddings of yet."""
        reached: list[tuple[SequenceImages, int]] = []
        for images, start, count in sequences:
            if images is None:
                continue
            for index, image in enumerate(images.images):
                if image.offset < start + count and start < image.end and index not in images.embeddings:
                    if image.pixel_values is None:
                        raise invalid_argument(f"the image at [{image.offset}, {image.end}) came without pixels "
                                               "to a step that computes its tokens")
                    reached.append((images, index))
        if reached:
            features = self.encode([images.images[index] for images, index in reached])
            for (images, index), feature in zip(reached, features):
                images.embeddings[index] = feature

    def _place(self, embeds: torch.Tensor, input_ids: torch.Tensor, row: int, images: SequenceImages,
               start: int, count: int) -> None:
        end = start + count
        for index, image in enumerate(images.images):
            low, high = max(start, image.offset), min(end, image.end)
            if low >= high:
                continue
            rows = slice(row + low - start, row + high - start)
            if not bool((input_ids[rows] == self.image_token_id).all()):
                raise invalid_argument(f"an image's span [{image.offset}, {image.end}) holds tokens other than "
                                       f"the image token {self.image_token_id}")
            embeds[rows] = images.embeddings[index][low - image.offset : high - image.offset].to(embeds.dtype)
            if high == image.end:  # no later step reads it
                del images.embeddings[index]
                images.images[index] = dataclasses.replace(image, pixel_values=None)


def _pair(value) -> tuple[int, int]:
    """An HF config's size: one int for a square, or (height, width)."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
