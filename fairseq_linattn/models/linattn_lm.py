"""``linattn_lm``: a GPT-style decoder-only LM (fairseq's transformer_lm) with causal plugin attention."""
from dataclasses import dataclass

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import (TransformerLanguageModel, TransformerLanguageModelConfig,
                                           base_lm_architecture, transformer_lm_gpt, transformer_lm_gpt2_small)

from ..analysis import install_attention_stats
from ..modules.layers import LinAttnTransformerDecoder
from ..modules.options import AttentionOptions, validate_attention_options


@dataclass
class LinAttnLMConfig(TransformerLanguageModelConfig, AttentionOptions):
    pass


def _all_lavo(args) -> bool:
    return all(t.strip() == "lavo" for t in str(args.decoder_attention_type).split(","))


@register_model("linattn_lm", dataclass=LinAttnLMConfig)
class LinAttnLanguageModel(TransformerLanguageModel):
    @classmethod
    def build_model(cls, args, task):
        """fairseq builds the embeddings (adaptive, character, tied ...); we swap in our decoder.

        (``--arch linattn_lm`` is the dataclass's own no-op architecture, so options are also checked here.)
        """
        _validate(args)
        if _all_lavo(args) and not getattr(args, "lavo_token_positions", False):
            args.no_token_positional_embeddings = True  # LAVO §4.1: relative bias only
        layers, args.decoder_layers = args.decoder_layers, 0  # the stock decoder only lends its embeddings
        try:
            stock = super().build_model(args, task)
        finally:
            args.decoder_layers = layers
        decoder = LinAttnTransformerDecoder(args, task.target_dictionary, stock.decoder.embed_tokens,
                                            no_encoder_attn=True)
        model = cls(decoder)
        install_attention_stats(model, args.attention_stats_interval)
        return model


def _validate(args):
    validate_attention_options(args, decoder_layers=args.decoder_layers)


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
