"""``linattn_transformer``: encoder-decoder (fairseq's transformer) with plugin self-attention and
softmax or LAVO cross-attention (--cross-attention-type)."""
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import base_architecture, tiny_architecture

from linattn.config import AttentionConfig

from ..modules.layers import LinAttnTransformerDecoder, LinAttnTransformerEncoder
from ..options import AttentionOptions, check_attention_options
from .on_build import after_build


@register_model("linattn_transformer")
class LinAttnTransformerModel(TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, AttentionOptions())

    @classmethod
    def build_model(cls, args, task):
        """Options validated by the architecture function (fairseq_linattn/options.py)."""
        model = super().build_model(args, task)
        after_build(model, AttentionConfig.from_args(args))
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return LinAttnTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return LinAttnTransformerDecoder(args, tgt_dict, embed_tokens,
                                         no_encoder_attn=getattr(args, "no_cross_attention", False))


def _validate(args):
    return check_attention_options(args, encoder_layers=args.encoder_layers, decoder_layers=args.decoder_layers)


@register_model_architecture("linattn_transformer", "linattn_transformer")
def linattn_transformer_architecture(args):
    base_architecture(args)
    _validate(args)


@register_model_architecture("linattn_transformer", "linattn_transformer_tiny")
def linattn_transformer_tiny(args):
    tiny_architecture(args)
    _validate(args)
