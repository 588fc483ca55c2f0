"""The transformers zoo's architectures, built as its tests build them: from each config class's
defaults (the number of layers cut) on the meta device, or at tiny widths with real weights. A
module of its own, importing torch and transformers only: the exported scripts' ranks import it
(their hooks), and a rank that imported the tests' modules would pay for pytest and the explorer."""
from __future__ import annotations

import inspect
import warnings

import torch
import transformers

#: name: (config class, model class, the config's number of layers cut to 4, what it stands for)
ZOO = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=4)),  # dense, tied head, learned positions
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_hidden_layers=4)),  # parallel residual
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_layer=4)),  # parallel residual, partial rotary
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_hidden_layers=4)),  # multi-query
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=4)),  # rotary, untied head
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=4)),  # sliding window, GQA
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_hidden_layers=4)),  # routed experts
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_hidden_layers=4)),  # routed + shared experts
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=4)),  # q/k norms
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_hidden_layers=4)),  # parallel attention and MLP
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=4)),  # fused qkv
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=4)),  # tied, scaled embedding
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_hidden_layers=4)),  # sliding and global, soft cap
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=4)),  # ALiBi
    "mpt": ("MptConfig", "MptForCausalLM", dict(n_layers=4)),  # ALiBi, no bias
    "opt": ("OPTConfig", "OPTForCausalLM", dict(num_hidden_layers=4)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_layer=4)),  # multi-query
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_hidden_layers=4)),  # partial rotary
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_hidden_layers=4)),  # sliding window
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(num_hidden_layers=4)),  # non-parametric norms
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # multi-latent attention, shared experts
                    dict(num_hidden_layers=4, first_k_dense_replace=1)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_hidden_layers=4)),  # parallel, tied
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(num_hidden_layers=4)),  # scaled residuals
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_layer=4)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(num_hidden_layers=4)),  # encoder, masked LM
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(num_hidden_layers=4)),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(num_hidden_layers=4)),  # image classifier
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(num_layers=4, num_decoder_layers=4)),  # enc-dec
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(encoder_layers=4, decoder_layers=4)),  # enc-dec
}
MOE = {"mixtral", "qwen2_moe", "deepseek_v3"}


def _megatron(prefix: str, columns: list[str], rows: list[str]) -> dict[str, str]:
    return {**{f"{prefix}{name}": "colwise" for name in columns}, **{f"{prefix}{name}": "rowwise" for name in rows}}


#: A tensor-parallel plan for each architecture whose config carries none: its attention's q, k, v
#: (or fused qkv) and its MLP's first projections column-sharded, the projections after them
#: row-sharded (Megatron-LM's layout).
TP_PLANS = {
    "gpt2": _megatron("transformer.h.*.", ["attn.c_attn", "mlp.c_fc"], ["attn.c_proj", "mlp.c_proj"]),
    "falcon": _megatron("transformer.h.*.", ["self_attention.query_key_value", "mlp.dense_h_to_4h"],
                        ["self_attention.dense", "mlp.dense_4h_to_h"]),
    "bloom": _megatron("transformer.h.*.", ["self_attention.query_key_value", "mlp.dense_h_to_4h"],
                       ["self_attention.dense", "mlp.dense_4h_to_h"]),
    "mpt": _megatron("transformer.blocks.*.", ["attn.Wqkv", "ffn.up_proj"], ["attn.out_proj", "ffn.down_proj"]),
    "opt": _megatron("model.decoder.layers.*.", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"],
                     ["self_attn.out_proj", "fc2"]),
    "gpt_bigcode": _megatron("transformer.h.*.", ["attn.c_attn", "mlp.c_fc"], ["attn.c_proj", "mlp.c_proj"]),
    "stablelm": _megatron("model.layers.*.", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "mlp.gate_proj", "mlp.up_proj"], ["self_attn.o_proj", "mlp.down_proj"]),
    **{name: _megatron(f"{name}.encoder.layer.*.", ["attention.self.query", "attention.self.key",
                                                    "attention.self.value", "intermediate.dense"],
                       ["attention.output.dense", "output.dense"]) for name in ("bert", "roberta")},
    "vit": _megatron("vit.layers.*.", ["attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"],
                     ["attention.o_proj", "mlp.fc2"]),
    "t5": {**_megatron("encoder.block.*.layer.", ["0.SelfAttention.q", "0.SelfAttention.k", "0.SelfAttention.v",
                                                  "1.DenseReluDense.wi"], ["0.SelfAttention.o", "1.DenseReluDense.wo"]),
           **_megatron("decoder.block.*.layer.", ["0.SelfAttention.q", "0.SelfAttention.k", "0.SelfAttention.v",
                                                  "1.EncDecAttention.q", "1.EncDecAttention.k", "1.EncDecAttention.v",
                                                  "2.DenseReluDense.wi"],
                       ["0.SelfAttention.o", "1.EncDecAttention.o", "2.DenseReluDense.wo"])},
    "bart": {**_megatron("model.encoder.layers.*.", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"],
                         ["self_attn.out_proj", "fc2"]),
             **_megatron("model.decoder.layers.*.", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "encoder_attn.q_proj", "encoder_attn.k_proj",
                                                     "encoder_attn.v_proj", "fc1"],
                         ["self_attn.out_proj", "encoder_attn.out_proj", "fc2"])},
}


def on_meta(name: str):
    config_class, model_class, layers = ZOO[name]
    config = getattr(transformers, config_class)(**layers)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_class)(config)
    if name == "vit":
        sample = torch.empty(8, 3, config.image_size, config.image_size, device="meta")
    elif name in ("t5", "bart"):
        ids = torch.zeros(8, 128, dtype=torch.long, device="meta")
        sample = {"input_ids": ids, "decoder_input_ids": ids}
    else:
        sample = torch.zeros(8, 128, dtype=torch.long, device="meta")
    return model, sample


#: Tiny widths for the runs with real weights (each config class takes the ones it knows).
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            n_embd=32, n_head=4, d_model=32, d_ff=64, num_heads=4, d_kv=8, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, head_dim=8, image_size=32, patch_size=8, rotary_dim=8, pad_token_id=0)
#: Where the tiny widths need one more word: multi-latent attention has no grouped key/value heads.
TINY_FOR = {"deepseek_v3": dict(num_key_value_heads=4)}


def tiny(name: str):
    """The architecture at tiny widths with real weights (2 layers), eval mode (dropout off, to
    compare), and a sample of 4 rows."""
    config_class, model_class, layers = ZOO[name]
    cls = getattr(transformers, config_class)
    accepted = set(inspect.signature(cls.__init__).parameters)
    options = {k: v for k, v in {**TINY, **TINY_FOR.get(name, {})}.items() if k in accepted}
    config = cls(**options, **{key: 2 if "layer" in key else value for key, value in layers.items()})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_class)(config).eval()
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return model, torch.randn(4, 3, 32, 32, generator=generator)
    ids = torch.randint(1, 128, (4, 8), generator=generator)
    return model, ({"input_ids": ids, "decoder_input_ids": ids} if name in ("t5", "bart") else ids)
