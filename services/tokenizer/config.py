"""Tokenizer/template service configuration (reference names in `alias`)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from services.common.api_keys import ApiKeySettings, check_api_keys
from services.common.config import require, setting
from services.common.drain import check_drain_timeout, drain_timeout_setting
from services.common.tls import InternalTlsSettings, check_internal_tls, health_port_setting
from services.common.model_files import DEFAULT_MODEL_NAME
from services.tokenizer.groups import POLICIES
from services.tokenizer.parsers import PARSERS, REASONING_PARSERS


@dataclass(frozen=True)
class TokenizerConfig(ApiKeySettings, InternalTlsSettings):
    """Chat template, tokenization, detokenization and the public ChatService."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port")
    metrics_port: int = setting(0, "HTTP port of the Prometheus /metrics endpoint (process metrics); 0 = off")
    scheduler_address: str = setting("127.0.0.1:50052", "scheduler host:port (when scheduler_addresses is empty)")
    scheduler_addresses: tuple[str, ...] = setting(
        (), "comma list of the schedulers (host:port) of several serving groups; each request goes to one, "
        "picked by prefix affinity bounded by load; empty = scheduler_address alone")
    scheduler_discovery: str = setting(
        "static", "how the schedulers are found: static (scheduler_addresses, else scheduler_address) or "
        "endpointslices (the ready endpoints of scheduler_service's EndpointSlices, watched through the "
        "Kubernetes API: a group per scheduler pod)")
    scheduler_service: str = setting("", "the schedulers' Service whose EndpointSlices are watched "
                                         "(scheduler_discovery=endpointslices)")
    scheduler_namespace: str = setting("", "its namespace; empty = this pod's")
    scheduler_port: str = setting("grpc", "the schedulers' port in the slices: a name or a number")
    group_prefix_blocks: int = setting(
        32, "leading 16-token blocks of a prompt hashed for group affinity, [1, 4096]")
    group_max_imbalance: int = setting(
        4, "a group with more than this many in-flight requests over the least loaded gets none by affinity, "
        "[0, 1000000]")
    group_policy: str = setting("affinity", "how a group is picked: affinity (bounded by load) or random")
    model_path: str = setting("", "HF directory or .gguf file; empty = the bundled SmolLM2-135M-Instruct",
                              alias="modelWeightPath")
    model_name: str = setting(DEFAULT_MODEL_NAME, "name clients send in `model`", alias="modelName")
    max_seq_len: int = setting(2560, "prompt + output cap in tokens", alias="maxSeqLen")
    max_input_token_len: int = setting(2048, "longest accepted prompt in tokens", alias="maxInputTokenLen")
    full_text_enabled: bool = setting(
        False, "stream deltas carry the whole text so far, and the final chunk `full_text`",
        alias="fullTextEnabled")
    tool_call_parser: str = setting(
        "", "tool-call format: " + ", ".join(PARSERS) + "; empty = detect from the model (hermes if unknown)")
    reasoning_parser: str = setting(
        "", "<think> reasoning: " + ", ".join(REASONING_PARSERS) + " force it on, `none` off; "
        "empty = on when the chat template mentions <think>")
    early_stopping_text: str = setting(
        "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
        "directly now.\n</think>\n\n",
        "appended when a request's chat_template_kwargs.thinking_budget is spent; must end the think block",
        alias="early_stopping_text")
    trust_request_chat_template: bool = setting(
        False, "render a template a request sends in chat_template_kwargs.chat_template; off: refused with "
        "422. Only for servers whose every client is trusted: a template is a program")
    template_timeout_s: float = setting(
        5.0, "seconds one chat-template render may run before it is stopped (the request gets 422), (0, 600]")
    template_memory_mib: int = setting(
        1024, "memory in MiB one render process may add to what it maps at start, [64, 65536]")
    render_processes: int = setting(
        2, "processes rendering the model's chat template, [1, 64]; request-supplied templates get one more")
    drain_timeout_s: float = drain_timeout_setting()
    # Media parts (image_url, video_url, audio_url): media.py.
    allowed_media_domains: tuple[str, ...] = setting(
        (), "comma list of the exact host names media URLs may name (MindIE's ALLOWED_MEDIA_DOMAINS_ENV); "
        "empty = any host whose addresses are public")
    media_dir: str = setting("/data/multimodal_inputs/", "directory local media paths must lie in (no symlinks)")
    media_allowed_networks: tuple[str, ...] = setting(
        (), "comma list of non-public networks (CIDR: 10.0.0.0/8, 127.0.0.1/32) media URLs may reach; "
        "empty = public addresses only (no loopback, private, link-local, CGNAT, multicast, reserved)")
    max_request_mib: int = setting(
        40, "largest image or audio item in MiB, [1, 100] (the edge's body limit of the same name)",
        alias="maxRequestLength")
    max_video_mib: int = setting(512, "largest video item in MiB, [1, 4096]")
    max_request_media_mib: int = setting(1000, "most MiB of media one request may bring, [1, 65536]")
    media_connect_timeout_s: float = setting(5.0, "seconds to connect to a media server, (0, 600]")
    media_read_timeout_s: float = setting(30.0, "seconds a media server may send nothing, (0, 600]")
    media_fetch_timeout_s: float = setting(
        60.0, "seconds one media fetch may take in all, redirects included, (0, 3600]")
    max_image_pixels: int = setting(
        89478485, "largest image (width x height) decoded, [1, 89478485] (PIL's own limit)")
    max_request_image_pixels: int = setting(
        100_000_000, "most pixels (width x height) all images of one request may have together, decoded, "
        "[1, 2000000000]; over it: 413")
    max_media_frames: int = setting(1000, "most frames of an animated image or a video, [1, 100000]")
    max_media_seconds: float = setting(600.0, "longest video or audio in seconds, (0, 86400]")
    media_cache_mib: int = setting(256, "MiB of fetched media kept by content hash, [0, 65536]")
    health_port: int = health_port_setting()

    def __post_init__(self) -> None:
        require(0 <= self.metrics_port <= 65535, f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        require(0 < len(self.model_name) <= 256, "modelName must have 1-256 characters")
        require(all(c.isascii() and (c.isalnum() or c in "_.-") for c in self.model_name),
                "modelName may contain only letters, digits, '_', '.' and '-'")
        require(self.max_seq_len >= 2, "maxSeqLen must be >= 2")
        require(1 <= self.group_prefix_blocks <= 4096, "group_prefix_blocks must be in [1, 4096]")
        require(0 <= self.group_max_imbalance <= 1_000_000, "group_max_imbalance must be in [0, 1000000]")
        require(self.group_policy in POLICIES, f"group_policy must be one of {', '.join(POLICIES)}")
        require(all(a.strip() for a in self.scheduler_addresses), "scheduler_addresses: an empty address")
        require(self.scheduler_discovery in ("static", "endpointslices"),
                "scheduler_discovery must be static or endpointslices")
        require(self.scheduler_discovery == "static" or bool(self.scheduler_service),
                "scheduler_discovery=endpointslices needs scheduler_service")
        require(self.tool_call_parser in ("", *PARSERS), f"tool_call_parser must be one of {', '.join(PARSERS)}")
        require(self.reasoning_parser in ("", "none", *REASONING_PARSERS),
                f"reasoning_parser must be none or one of {', '.join(REASONING_PARSERS)}")
        require(1 <= self.max_input_token_len <= 4194304, "maxInputTokenLen must be in [1, 4194304]")
        require(0 < self.template_timeout_s <= 600, "template_timeout_s must be in (0, 600]")
        require(64 <= self.template_memory_mib <= 65536, "template_memory_mib must be in [64, 65536]")
        require(1 <= self.render_processes <= 64, "render_processes must be in [1, 64]")
        require("</think>" in self.early_stopping_text, "early_stopping_text must contain </think>")
        check_drain_timeout(self.drain_timeout_s)
        require(1 <= self.max_request_mib <= 100, "max_request_mib (maxRequestLength) must be in [1, 100]")
        require(1 <= self.max_video_mib <= 4096, "max_video_mib must be in [1, 4096]")
        require(1 <= self.max_request_media_mib <= 65536, "max_request_media_mib must be in [1, 65536]")
        for name in ("media_connect_timeout_s", "media_read_timeout_s"):
            require(0 < getattr(self, name) <= 600, f"{name} must be in (0, 600]")
        require(0 < self.media_fetch_timeout_s <= 3600, "media_fetch_timeout_s must be in (0, 3600]")
        require(1 <= self.max_image_pixels <= 89478485, "max_image_pixels must be in [1, 89478485]")
        require(1 <= self.max_request_image_pixels <= 2_000_000_000,
                "max_request_image_pixels must be in [1, 2000000000]")
        require(1 <= self.max_media_frames <= 100000, "max_media_frames must be in [1, 100000]")
        require(0 < self.max_media_seconds <= 86400, "max_media_seconds must be in (0, 86400]")
        require(0 <= self.media_cache_mib <= 65536, "media_cache_mib must be in [0, 65536]")
        check_api_keys(self.api_keys)
        check_internal_tls(self)
        require(os.path.isabs(self.media_dir), "media_dir must be an absolute path")
        for network in self.media_allowed_networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                require(False, f"media_allowed_networks: {network!r} is not a network (CIDR)")
