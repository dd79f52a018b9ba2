"""``linattn_lm``: a GPT-style decoder-only LM (fairseq's transformer_lm) with causal plugin attention."""
from dataclasses import dataclass

from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_gpt,
    transformer_lm_gpt2_small,
)

from linattn.config import AttentionConfig
from linattn.methods import METHODS, layer_types

from ..modules.layers import LinAttnTransformerDecoder
from ..options import AttentionOptions, check_attention_options
from .on_build import after_build


@dataclass
class LinAttnLMConfig(TransformerLanguageModelConfig, AttentionOptions):
    pass


def _relative_positions_only(config, layers: int) -> bool:
    """Every layer's attention brings its own (relative) positions, e.g. LAVO's bias (LAVO §4.1)."""
    return all(METHODS[t].relative_positions for t in layer_types(config.decoder_attention_type, layers, "decoder"))


@register_model("linattn_lm", dataclass=LinAttnLMConfig)
class LinAttnLanguageModel(TransformerLanguageModel):
    @classmethod
    def build_model(cls, args, task):
        """fairseq builds the embeddings (adaptive, character, tied ...); we swap in our decoder.

        Validates the options only for ``--arch linattn_lm``, the dataclass's own architecture: no plugin function
        checked them (fairseq_linattn/options.py); the other architectures' functions did.
        """
        checked = getattr(args, "arch", None) in ARCHITECTURES
        config = AttentionConfig.from_args(args) if checked else _validate(args)
        if _relative_positions_only(config, args.decoder_layers) and not config.lavo_token_positions:
            args.no_token_positional_embeddings = True  # LAVO §4.1: relative bias only
        layers, args.decoder_layers = args.decoder_layers, 0  # the stock decoder only lends its embeddings
        try:
            stock = super().build_model(args, task)
        finally:
            args.decoder_layers = layers
        decoder = LinAttnTransformerDecoder(args, task.target_dictionary, stock.decoder.embed_tokens,
                                            no_encoder_attn=True)
        model = cls(decoder)
        after_build(model, config)
        return model


def _validate(args):
    return check_attention_options(args, decoder_layers=args.decoder_layers)


def linattn_lm(args):
    """``--arch linattn_lm``, the dataclass's own architecture: fairseq registers a no-op for it (and registering
    again is refused); this one validates at parse time, as the other architectures' functions do. fairseq's
    parser leaves a dataclass model's unset options out of ``args`` (their defaults come at build time)."""
    check_attention_options(args, decoder_layers=getattr(args, "decoder_layers", LinAttnLMConfig.decoder_layers))


ARCH_CONFIG_REGISTRY["linattn_lm"] = linattn_lm


ARCHITECTURES = ("linattn_lm_gpt", "linattn_lm_gpt2_small", "linattn_lm_tiny")  # each validates (below)


@register_model_architecture("linattn_lm", "linattn_lm_gpt")
def linattn_lm_gpt(args):
    """768-d, 12 layers, 12 heads: GPT-2 small sized (LAVO's PG-19 model)."""
    transformer_lm_gpt(args)
    _validate(args)


@register_model_architecture("linattn_lm", "linattn_lm_gpt2_small")
def linattn_lm_gpt2_small(args):
    transformer_lm_gpt2_small(args)
    _validate(args)


@register_model_architecture("linattn_lm", "linattn_lm_tiny")
def linattn_lm_tiny(args):
    """2 layers, 64-d, 2 heads: for tests and the CPU quick-start."""
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 64)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 128)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    base_lm_architecture(args)
    _validate(args)
