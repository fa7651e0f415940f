"""Tokenizers and scripted scheduler output for the tool/reasoning tests."""
from __future__ import annotations

from transformers import AutoTokenizer

from services.common.model_files import default_model_path, resolve_model
from services.tokenizer.parsers import deepseek
from stormserve.scheduler.v1 import scheduler_pb2

DEEPSEEK_MARKERS = [deepseek.CALLS_BEGIN, deepseek.CALLS_END, deepseek.CALL_BEGIN, deepseek.CALL_END, deepseek.SEP]


def smol_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


def deepseek_like_tokenizer():
    """The bundled tokenizer with DeepSeek's tool markers added as *special*
    tokens, as a DeepSeek tokenizer may have them: decoding with
    skip_special_tokens drops them unless the detokenizer keeps them."""
    tokenizer = smol_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": DEEPSEEK_MARKERS})
    return tokenizer


def token_responses(ids: list[int], finish: int = scheduler_pb2.FINISH_REASON_STOP,
                    eos: int | None = None) -> list[scheduler_pb2.GenerateResponse]:
    """One scheduler message per token; the last ends the sequence (with `eos`
    appended as the stop token, never shown)."""
    out = [scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(token_id=i, batch_size=1)])
           for i in ids]
    if eos is not None:
        out.append(scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(token_id=eos)],
                                                  ended_by_stop_token=True))
    out[-1].finish_reason = finish
    return out
