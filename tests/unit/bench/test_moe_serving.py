"""bench.moe_serving's two models: the MoE one and a dense one of the same
active parameters per token, written with the bundled tokenizer."""
from __future__ import annotations

from argparse import Namespace

from transformers import AutoTokenizer

from bench import moe_serving
from services.common.model_files import default_model_path, resolve_model


def test_the_dense_model_has_the_moe_models_active_parameters(tmp_path) -> None:
    args = Namespace(hidden=64, layers=3, heads=4, experts=16, top_k=4, moe_intermediate=32)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    moe, dense = moe_serving.configs(args, 512)
    active = {name: moe_serving.build(tmp_path / name, config, tokenizer)
              for name, config in (("moe", moe), ("dense", dense))}
    assert abs(active["moe"] - active["dense"]) < 0.02 * active["dense"], active
    assert (tmp_path / "moe" / "tokenizer.json").exists() and (tmp_path / "dense" / "config.json").exists()
