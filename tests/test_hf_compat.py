"""The transformers-release seam (``model.hf_compat``): our forwards pass the KV cache under the name the
installed release takes, so no rank prints a deprecation warning (each rank must print one clear line on a
failure, see tests/test_faults.py). transformers 5.24 renamed ``past_key_values`` to ``cache``."""
from __future__ import annotations

import inspect
import warnings

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

from draft.ssm import SmallLMDrafter
from model.hf_compat import cache_arg, output_cache
from model.layers import LayerBlock
from tests.helpers import tiny_llama


def test_cache_kwarg_is_a_parameter_of_this_release():
    for cls in (LlamaDecoderLayer, LlamaForCausalLM):
        name = cache_arg(cls)
        assert name in inspect.signature(cls.forward).parameters


def test_output_cache_reads_either_field():
    assert output_cache({"cache": 1}) == 1
    assert output_cache({"past_key_values": 2}) == 2


def test_layer_block_and_small_lm_forward_without_warnings(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    block = LayerBlock(cfg, 2).eval()
    cache = block.new_cache(16, torch.float32, "cpu")
    path = tiny_llama(tmp_path / "ssm", layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randn(1, 3, 32)
        mask = torch.zeros(1, 1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
        with torch.no_grad():
            out = block(x, torch.arange(3)[None], mask, cache)
        assert out.shape == x.shape
        d = SmallLMDrafter(path, vocab_size=96)
        h = d.start([1, 5, 9], 13, None)
        h = d.commit(torch.tensor([7]), None)
        assert d.cache is not None and h.shape == (96,)
