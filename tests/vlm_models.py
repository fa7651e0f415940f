"""Tiny random-weight vision-language models of the two supported families,
saved as HF directories the services load like any other: the bundled
SmolLM2 tokenizer plus the family's image tokens, a chat template that writes
the family's image placeholder, the family's own image processor config, and
float32 weights from a fixed seed. No VLM weights can be downloaded here."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from services.common.model_files import default_model_path, resolve_model

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl")
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LLAVA_IMAGE_TOKEN = "<image>"
# LLaVA: a 56 x 56 image in 14-pixel patches, CLS dropped: 16 tokens per image.
LLAVA_IMAGE_SIZE = 56
LLAVA_TOKENS_PER_IMAGE = (LLAVA_IMAGE_SIZE // 14) ** 2
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)

# ChatML as SmolLM2 writes it, with the family's placeholder where an image part is.
_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message.role != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}PLACEHOLDER{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_vlm(family: str, directory: Path) -> Path:
    """Write a tiny `family` model (one of FAMILIES) to `directory`; returns it."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    torch.manual_seed(0)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
        start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
        text = dict(**TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        tokens = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                      video_token_id=video)
        if family == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2)
            config = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        else:  # window attention over 56-pixel windows, the second block attending the whole image
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                          window_size=56, fullatt_block_indexes=[1])
            config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        # Up to 16 tokens an image (a 112 x 112 one); a 56 x 56 image gives 4.
        processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    elif family == "llava":
        tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=LLAVA_IMAGE_SIZE, patch_size=14,
                                           projection_dim=32),
            text_config=LlamaConfig(**TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id),
            image_token_id=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
            vision_feature_layer=-2, vision_feature_select_strategy="default",
        )
        processor = LlavaImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIZE},
                                           crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
        placeholder = LLAVA_IMAGE_TOKEN
    else:
        raise ValueError(f"unknown family {family}")
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(directory)
    tokenizer.chat_template = _TEMPLATE.replace("PLACEHOLDER", placeholder)
    tokenizer.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
