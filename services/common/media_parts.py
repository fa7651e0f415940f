"""What the API pages fix about media parts, for the edge (which validates the
JSON) and the tokenizer (which fetches them, also for gRPC callers)."""

MAX_MEDIA_PARTS = 20  # image_url, video_url and audio_url parts per request (reference §9.10)
