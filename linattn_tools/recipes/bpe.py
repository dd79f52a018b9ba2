"""Sub-word tokenisation of text files, one output line per input line (empty lines kept).

Two tokenisers:
- ``gpt2``: GPT-2 byte-level BPE with fairseq's own encoder (``fairseq.data.encoders.gpt2_bpe_utils``)
  and fairseq's ``dict.txt``, as the RoBERTa and GPT-2 recipes use; lines become token ids.
- ``sentencepiece``: a SentencePiece model trained on the training split; lines become pieces, and
  ``dict.txt`` lists the model's pieces in id order.
"""
import hashlib
import multiprocessing
import shutil
import urllib.request
from itertools import islice
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from tqdm import tqdm

from .sources import SourceError

GPT2_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/"
GPT2_FILES = ("encoder.json", "vocab.bpe", "dict.txt")
TOKENIZERS = ("gpt2", "sentencepiece")
_CHUNK = 2000

_encoder = None  # per worker process


def gpt2_files(directory: Path, download: bool = True) -> Dict[str, str]:
    """Paths of encoder.json, vocab.bpe, dict.txt in ``directory``, downloading missing ones if allowed."""
    directory = Path(directory)
    missing = [name for name in GPT2_FILES if not (directory / name).is_file()]
    if missing and download:
        directory.mkdir(parents=True, exist_ok=True)
        for name in missing:
            print(f"[prepare] downloading {GPT2_URL}{name}", flush=True)
            tmp = directory / (name + ".partial")
            try:
                with urllib.request.urlopen(GPT2_URL + name, timeout=60) as response, open(tmp, "wb") as f:
                    shutil.copyfileobj(response, f)
            except OSError as err:
                raise SourceError(f"could not download the GPT-2 BPE file {name} ({type(err).__name__}: {err}).\n"
                                  f"Without network access, copy {', '.join(GPT2_FILES)} from {GPT2_URL} into "
                                  f"a directory and pass it: --gpt2-dir DIR") from err
            tmp.replace(directory / name)
        missing = []
    if missing:
        raise SourceError(f"--gpt2-dir {directory}: missing {', '.join(missing)} (GPT-2 BPE files from {GPT2_URL})")
    return {name.split(".")[0]: str(directory / name) for name in GPT2_FILES}


def train_sentencepiece(train_text: Path, out_dir: Path, vocab_size: int, threads: int = 1,
                        max_sentences: int = 2_000_000) -> Dict[str, str]:
    """Train a BPE SentencePiece model on ``train_text``; write ``spm.model`` and fairseq ``dict.txt``."""
    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(train_text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        num_threads=threads, minloglevel=2)
    model = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    with open(out_dir / "dict.txt", "w", encoding="utf-8") as f:
        for i in range(model.get_piece_size()):
            if not (model.is_control(i) or model.is_unknown(i)):  # fairseq adds its own <s> <pad> </s> <unk>
                f.write(f"{model.id_to_piece(i)} 1\n")
    return {"model": str(prefix) + ".model", "dict": str(out_dir / "dict.txt")}


def _init_worker(spec: dict) -> None:
    global _encoder
    if spec["kind"] == "gpt2":
        from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

        bpe = get_encoder(spec["encoder"], spec["vocab"])
        _encoder = lambda lines: [" ".join(map(str, bpe.encode(line))) for line in lines]  # noqa: E731
    elif spec["kind"] == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=spec["model"])
        _encoder = lambda lines: [" ".join(pieces) for pieces in sp.encode(lines, out_type=str)]  # noqa: E731
    else:
        raise ValueError(f"tokenizer kind must be one of {TOKENIZERS}, got {spec['kind']!r}")


def _encode_chunk(lines: List[str]) -> List[str]:
    # as fairseq's multiprocessing_bpe_encoder --keep-empty: strip, keep empty lines empty
    stripped = [line.strip() for line in lines]
    encoded = iter(_encoder([line for line in stripped if line]))
    return [next(encoded) if line else "" for line in stripped]


def _chunks(path: Path) -> Iterator[List[str]]:
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = list(islice(f, _CHUNK))
            if not chunk:
                return
            yield chunk


def encode_file(spec: dict, src: Path, dst: Path, workers: int = 1) -> None:
    """Tokenise ``src`` line by line into ``dst`` with ``workers`` processes (a progress bar per file)."""
    with open(src, encoding="utf-8") as f:
        total = sum(1 for _ in f)
    bar = tqdm(total=total, unit=" lines", desc=f"encode {Path(src).name}", mininterval=2)
    with open(dst, "w", encoding="utf-8") as out:
        if workers > 1:
            with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec,)) as pool:
                for encoded in pool.imap(_encode_chunk, _chunks(src)):
                    out.writelines(line + "\n" for line in encoded)
                    bar.update(len(encoded))
        else:
            _init_worker(spec)
            for chunk in _chunks(src):
                out.writelines(line + "\n" for line in _encode_chunk(chunk))
                bar.update(len(chunk))
    bar.close()


def tokenizer_spec(kind: str, assets: Dict[str, str]) -> dict:
    """The picklable description worker processes build their encoder from."""
    if kind == "gpt2":
        return {"kind": kind, "encoder": assets["encoder"], "vocab": assets["vocab"]}
    if kind == "sentencepiece":
        return {"kind": kind, "model": assets["model"]}
    raise ValueError(f"--bpe must be one of {', '.join(TOKENIZERS)}, got {kind!r}")


def describe(assets: Dict[str, str]) -> dict:
    """Identity of tokeniser assets for completion markers: {name: sha1 of the file}."""
    return {k: hashlib.sha1(Path(v).read_bytes()).hexdigest() for k, v in sorted(assets.items())}


def add_tokenizer_args(parser, sp_vocab_size: Optional[int]) -> None:
    """--bpe, --gpt2-dir, --workers; and --sp-vocab-size (train a model) or --sp-model/--sp-dict (reuse one)."""
    parser.add_argument("--bpe", choices=TOKENIZERS, default="gpt2",
                        help="gpt2: fairseq's GPT-2 BPE and dict.txt (the papers' setting); sentencepiece: "
                             "a SentencePiece model (default: %(default)s)")
    parser.add_argument("--gpt2-dir", help="directory with encoder.json, vocab.bpe, dict.txt (downloaded into it "
                                           "when missing and online; default: OUT/gpt2_bpe)")
    if sp_vocab_size:
        parser.add_argument("--sp-vocab-size", type=int, default=sp_vocab_size,
                            help="vocabulary of the SentencePiece model trained on the training split "
                                 "(default: %(default)s)")
    else:
        parser.add_argument("--sp-model", help="the pretraining run's SentencePiece model (with --bpe sentencepiece)")
        parser.add_argument("--sp-dict", help="the pretraining run's dict.txt (with --bpe sentencepiece)")
    parser.add_argument("--workers", type=int, default=1, help="processes for encoding and fairseq-preprocess")


def prepare_tokenizer(args, train_text: Optional[Path], out: Path, upstream: dict) -> Dict[str, str]:
    """GPT-2 files (``--gpt2-dir``), the given SentencePiece model, or one trained on ``train_text``."""
    from .steps import run_step

    if args.bpe == "gpt2":
        return gpt2_files(Path(args.gpt2_dir) if args.gpt2_dir else out / "gpt2_bpe")
    if train_text is None:
        if not (args.sp_model and args.sp_dict):
            raise SourceError("--bpe sentencepiece needs --sp-model and --sp-dict: the pretrained model's "
                              "SentencePiece model and dict.txt (fine-tuning must reuse its vocabulary)")
        return {"model": args.sp_model, "dict": args.sp_dict}
    params = {"vocab_size": args.sp_vocab_size, "input": upstream}
    run_step("sentencepiece", out / "spm", params,
             lambda tmp: train_sentencepiece(train_text, tmp, args.sp_vocab_size, args.workers))
    return {"model": str(out / "spm" / "spm.model"), "dict": str(out / "spm" / "dict.txt")}
