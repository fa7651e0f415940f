"""What the API pages fix about media parts, for the edge (which validates the
JSON) and the tokenizer (which fetches them, also for gRPC callers); which
vision-language models the tokenizer and the worker serve; and how many image
pixels travel down the chain at once."""

MAX_MEDIA_PARTS = 20  # image_url, video_url and audio_url parts per request (reference §9.10)
# Image pixels (float32 on the wire) one request, and one engine step, may carry:
# three quarters of a gRPC message (grpc_server.MAX_MESSAGE_BYTES, 64 MiB), the
# rest left for the step's tokens and block tables.
MAX_STEP_IMAGE_BYTES = 48 * 1024 * 1024
# Vision-language model types served (config.json's model_type), and those of
# them with dynamic resolution and multimodal rotary positions (Qwen2-VL's kind).
VISION_MODEL_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl")
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def has_vision_tower(model_config) -> bool:
    """Whether an HF config is a vision-language model's (its tower's own config inside)."""
    return getattr(model_config, "vision_config", None) is not None
