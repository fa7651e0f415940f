"""Conversation -> prompt token ids under a budget: the template renders in a
render process (render_pool.py) within `template_timeout_s` and
`template_memory_mib`, its output is refused past the character count that
the input limit could ever hold, and only then is it tokenized."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from services.common.errors import ServiceError, invalid_argument
from services.common.template_kwargs import REQUEST_TEMPLATE_KEY
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.media import MediaFetcher, MediaPolicy
from services.tokenizer.multimodal import ImageProcessor
from services.tokenizer.render_pool import RenderCrashed, RenderLane, RenderTimeout
from services.tokenizer.template import RenderedPrompt, media_parts, reject_unsafe_kwargs, render_jobs
from stormserve.chat.v1 import chat_pb2

log = logging.getLogger(__name__)
# Room for normalizers that shrink text before it is split into tokens.
CHARS_MARGIN = 2
# Client-supplied templates render at the lowest CPU priority.
REQUEST_TEMPLATE_NICE = 19


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of this vocabulary stands for (a byte-level
    token's string has one character per byte, at least one per decoded character)."""
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t is not None)


def too_long(limit: int, length: str) -> ServiceError:
    """The documented refusal of a prompt over maxInputTokenLen (HTTP 424)."""
    return ServiceError(
        grpc.StatusCode.OUT_OF_RANGE,
        "Failed to enqueue inferRequest. This model's maximum input ids length cannot be greater "
        f"than {limit},the input ids length is {length}",
    )


class PromptBuilder:
    def __init__(self, config: TokenizerConfig, tokenizer, max_input_tokens: int,
                 images: ImageProcessor | None = None):
        """`images`: a vision-language model's image processor; None refuses media parts."""
        self.config = config
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.images = images
        self.media = MediaFetcher(MediaPolicy.from_config(config)) if images is not None else None
        # More characters than this can never fit max_input_tokens tokens.
        self.max_chars = max_input_tokens * longest_token_chars(tokenizer) * CHARS_MARGIN
        self.model_lane = RenderLane("model", config.render_processes, config.template_timeout_s,
                                     config.template_memory_mib)
        self.request_lane = None
        if config.trust_request_chat_template:
            self.request_lane = RenderLane("request", 1, config.template_timeout_s, config.template_memory_mib,
                                           nice=REQUEST_TEMPLATE_NICE)

    def warm_up(self) -> None:
        for lane in (self.model_lane, self.request_lane):
            if lane is not None:
                lane.warm_up()

    def close(self) -> None:
        for lane in (self.model_lane, self.request_lane):
            if lane is not None:
                lane.close()

    async def render(self, messages: list[chat_pb2.ChatMessage], tools: list[chat_pb2.Tool],
                     template_kwargs: dict[str, Any], add_generation_prompt: bool = True) -> RenderedPrompt:
        reject_unsafe_kwargs(template_kwargs, self.request_lane is not None)
        lane = self.request_lane if REQUEST_TEMPLATE_KEY in template_kwargs else self.model_lane
        jobs = render_jobs(self.tokenizer, list(messages), list(tools), template_kwargs, add_generation_prompt,
                           self.max_chars, accepts_images=self.images is not None)
        # Checked and fetched before the render: a refused part costs no render.
        parts = media_parts(list(messages))
        items = await self.media.fetch_all(parts) if parts and self.media is not None else []
        answer = await self._render(lane, jobs[0])
        if answer.get("error_type") == "TypeError" and len(jobs) > 1:
            answer = await self._render(lane, jobs[1])
        if "too_long" in answer:
            raise too_long(self.max_input_tokens, f"above {self.max_input_tokens} (the chat template wrote "
                                                  f"{answer['too_long']} characters)")
        if "error" in answer:
            raise invalid_argument(f"chat template failed: {answer['error']}")
        text = answer["text"]
        token_ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.tokenizer.encode(text, add_special_tokens=False))
        if self.images is None:
            return RenderedPrompt(text=text, token_ids=token_ids)
        token_ids, images = await asyncio.to_thread(self.images.expand, token_ids, items)
        return RenderedPrompt(text=text, token_ids=token_ids, images=images)

    async def _render(self, lane: RenderLane, job: dict[str, Any]) -> dict[str, Any]:
        try:
            return await lane.render(job)
        except RenderTimeout:
            raise invalid_argument(
                f"chat template failed: it did not finish within {self.config.template_timeout_s:g} s") from None
        except RenderCrashed:
            log.error("a chat template render process died before answering")
            raise ServiceError(grpc.StatusCode.INTERNAL, "the chat template render failed") from None
