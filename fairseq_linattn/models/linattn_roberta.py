"""``linattn_roberta``: RoBERTa (masked LM + classification heads) with any attention of the plugin."""
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta.model import (
    RobertaEncoder,
    RobertaModel,
    base_architecture,
    roberta_base_architecture,
    roberta_large_architecture,
)
from fairseq.modules.transformer_sentence_encoder import init_bert_params

from linattn.config import AttentionConfig

from ..modules.layers import LinAttnTransformerEncoder
from ..options import AttentionOptions, check_attention_options
from .on_build import after_build


class LinAttnRobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = LinAttnTransformerEncoder(args, dictionary, embed_tokens)
        encoder.apply(init_bert_params)
        return encoder


@register_model("linattn_roberta")
class LinAttnRobertaModel(RobertaModel):
    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        gen_parser_from_dataclass(parser, AttentionOptions())

    @classmethod
    def build_model(cls, args, task):
        """As RobertaModel.build_model, with the plugin's encoder (options validated by the architecture
        function: fairseq_linattn/options.py)."""
        base_architecture(args)
        config = AttentionConfig.from_args(args)
        if not hasattr(args, "max_positions"):
            args.max_positions = getattr(args, "tokens_per_sample", None) or task.max_positions()
        model = cls(args, LinAttnRobertaEncoder(args, task.source_dictionary))
        after_build(model, config)
        return model


def _validate(args):
    return check_attention_options(args, encoder_layers=args.encoder_layers)


@register_model_architecture("linattn_roberta", "linattn_roberta")
def linattn_roberta_architecture(args):
    base_architecture(args)
    _validate(args)


@register_model_architecture("linattn_roberta", "linattn_roberta_base")
def linattn_roberta_base(args):
    roberta_base_architecture(args)
    _validate(args)


@register_model_architecture("linattn_roberta", "linattn_roberta_large")
def linattn_roberta_large(args):
    roberta_large_architecture(args)
    _validate(args)


@register_model_architecture("linattn_roberta", "linattn_roberta_tiny")
def linattn_roberta_tiny(args):
    """2 layers, 64-d, 2 heads: for tests and the CPU quick-start."""
    args.encoder_layers = getattr(args, "encoder_layers", 2)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 64)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 128)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 2)
    base_architecture(args)
    _validate(args)
