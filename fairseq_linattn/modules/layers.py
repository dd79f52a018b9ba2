"""fairseq encoder/decoder (and their layers) whose attention is built by ``build_attention``.

Only the builders are overridden (the fairseq linformer-plugin pattern); fairseq's
``checkpoint_wrapper`` and ``fsdp_wrap`` are kept exactly as in the parents' builders.
"""
import itertools

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerConfig, TransformerDecoder, TransformerEncoder
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from linattn.config import AttentionConfig
from linattn.methods import layer_types

from .build import build_attention


def _wrap(layer, cfg):
    """As fairseq's build_encoder_layer / build_decoder_layer: activation checkpointing, then FSDP."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class LinAttnEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, method: str, config: AttentionConfig, return_fc: bool = False):
        self.attention_type, self.attention_config = method, config  # read by build_self_attention in super().__init__
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return build_attention(self.attention_type, embed_dim, cfg.encoder.attention_heads, causal=False,
                               dropout=cfg.attention_dropout, config=self.attention_config)


class LinAttnDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, method: str, config: AttentionConfig, no_encoder_attn: bool = False):
        self.attention_type, self.attention_config = method, config
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("linattn decoders support neither --cross-self-attention nor bias_kv/zero_attn")
        return build_attention(self.attention_type, embed_dim, cfg.decoder.attention_heads, causal=True,
                               dropout=cfg.attention_dropout, config=self.attention_config)

    def build_encoder_attention(self, embed_dim, cfg):
        method = self.attention_config.cross_attention_type
        if method == "softmax":  # fairseq's own MultiheadAttention, as in a stock transformer
            return super().build_encoder_attention(embed_dim, cfg)
        return build_attention(method, embed_dim, cfg.decoder.attention_heads, causal=False, cross=True,
                               kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
                               dropout=cfg.attention_dropout, config=self.attention_config)


class LinAttnTransformerEncoder(TransformerEncoder):
    """fairseq's TransformerEncoder with per-layer attention types (--encoder-attention-type)."""

    def __init__(self, args, dictionary, embed_tokens, return_fc=False):
        num_layers = TransformerConfig.from_namespace(args).encoder.layers
        self.attention_config = AttentionConfig.from_args(args)
        self.layer_attention_types = layer_types(self.attention_config.encoder_attention_type, num_layers, "encoder")
        self._next_layer = itertools.count()
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, args):
        cfg = TransformerConfig.from_namespace(args)
        method = self.layer_attention_types[next(self._next_layer)]
        return _wrap(LinAttnEncoderLayer(cfg, method, self.attention_config, return_fc=self.return_fc), cfg)


class LinAttnTransformerDecoder(TransformerDecoder):
    """fairseq's TransformerDecoder with causal per-layer attention types (--decoder-attention-type)."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        num_layers = TransformerConfig.from_namespace(args).decoder.layers
        self.attention_config = AttentionConfig.from_args(args)
        self.layer_attention_types = layer_types(self.attention_config.decoder_attention_type, num_layers, "decoder")
        self._next_layer = itertools.count()
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)

    def build_decoder_layer(self, args, no_encoder_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        method = self.layer_attention_types[next(self._next_layer)]
        return _wrap(LinAttnDecoderLayer(cfg, method, self.attention_config, no_encoder_attn), cfg)

    def buffered_future_mask(self, tensor):
        """None: every self-attention built here is causal by construction, so the (T, T) mask fairseq
        would build and keep (O(T²) memory, 1 GiB at T = 16K) is never needed."""
        return None
