"""python -m services.tokenizer: run the ChatService and TokenizerService."""
from __future__ import annotations

import asyncio

import grpc
from transformers import AutoConfig, AutoTokenizer

from services.common.api_keys import KeyStore
from services.common.config import load_config
from services.common.grpc_server import GrpcService, channel
from services.common.kube import EndpointSliceWatcher, KubeApi, KubeConfigError
from services.common import tracing
from services.common.log import setup_logging
from services.common.media_parts import has_vision_tower
from services.common.metrics import process_registry, serve_metrics_in_thread
from services.common.supervisor import exit_with_supervisor
from services.common.tls import InternalTls
from services.common.model_files import resolve_model
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.groups import GroupPicker
from services.tokenizer.key_gate import KeyGate, KeyMetrics
from services.tokenizer.multimodal import ImageProcessor
from services.tokenizer.scheduler_groups import SchedulerGroups, group_addresses
from services.tokenizer.server import ChatServicer, SchedulerClient, TokenizerCore, TokenizerServicer
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from stormserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

UPSTREAM_POLL_S = 1.0


async def main() -> None:
    exit_with_supervisor()
    config = load_config(TokenizerConfig)
    log = setup_logging("tokenizer")
    tracing.setup("tokenizer")
    tls = InternalTls.of(config)
    service = GrpcService("tokenizer", config.host, config.port, config.drain_timeout_s, tls, config.health_port)
    registry = process_registry() if config.metrics_port else None
    gate = KeyGate(KeyStore.from_config(config), KeyMetrics(registry) if registry is not None else None)
    if registry is not None:
        serve_metrics_in_thread(registry, config.host, config.metrics_port)
    model_dir = await asyncio.to_thread(resolve_model, config.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = AutoConfig.from_pretrained(model_dir)
    text_config = model_config.get_text_config()
    images = ImageProcessor(model_dir, model_config) if has_vision_tower(model_config) else None
    core = TokenizerCore(config, tokenizer, str(model_dir),
                         getattr(text_config, "max_position_embeddings", config.max_seq_len),
                         model_type=getattr(model_config, "model_type", "") or "", images=images)
    # Render processes start before the service says it is serving, not on the first requests.
    await asyncio.to_thread(core.prompts.warm_up)

    def connect(address: str) -> tuple[SchedulerClient, grpc.aio.Channel]:
        chan = channel(address, tls)
        return SchedulerClient(chan), chan

    watcher = None
    if config.scheduler_discovery == "endpointslices":
        addresses = []  # from the first list of the slices on
        try:
            api = KubeApi.from_environment(config.scheduler_namespace)
        except KubeConfigError as exc:
            raise SystemExit(f"scheduler_discovery=endpointslices: {exc}") from None
    else:
        addresses = group_addresses(config.scheduler_address, config.scheduler_addresses)
    picker = GroupPicker((), config.group_prefix_blocks, config.group_max_imbalance, config.group_policy)
    scheduler = SchedulerGroups({}, {}, picker)
    scheduler.set_groups(addresses, connect)
    if config.scheduler_discovery == "endpointslices":
        async def on_slices(slices) -> None:
            scheduler.apply_slices(slices, config.scheduler_port, connect)

        watcher = asyncio.create_task(EndpointSliceWatcher(api, config.scheduler_service, on_slices).run())
    service.add(chat_pb2_grpc.add_ChatServiceServicer_to_server, ChatServicer(core, scheduler, gate, service.drain),
                chat_pb2.DESCRIPTOR.services_by_name["ChatService"])
    service.add(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, TokenizerServicer(core, gate),
                tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"])
    await service.start()
    log.info("model %s from %s; input limit %d tokens (templates may write %d characters); tool format %s; "
             "reasoning %s; request-supplied chat templates %s", config.model_name, model_dir,
             core.max_input_tokens, core.prompts.max_chars, core.formats.tool_parser, core.formats.reasoning,
             "trusted" if config.trust_request_chat_template else "refused")

    async def on_serving(now: bool) -> None:
        # Ready only while a scheduler behind us is: health checks see the whole chain.
        await service.set_serving(now)
        log.info("serving: %s", now)

    if len(addresses) > 1:
        log.info("%d serving groups: %s (%s)", len(addresses), ", ".join(addresses), config.group_policy)
    elif watcher is not None:
        log.info("serving groups: the schedulers of Service %s (%s)", config.scheduler_service, config.group_policy)
    follower = asyncio.create_task(scheduler.follow(on_serving, UPSTREAM_POLL_S))
    # Its callers need no new RPC for a running call: new ones go to another replica.
    await service.serve_forever(stop_listening=True)
    follower.cancel()
    if watcher is not None:
        watcher.cancel()
    await scheduler.close()
    core.prompts.close()


if __name__ == "__main__":
    asyncio.run(main())
