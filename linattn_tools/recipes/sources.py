"""Load a dataset's splits through HuggingFace ``datasets``: from the hub, or from a local directory.

A local directory is read in the hub's own layout (``<config>/<split>-00000-of-00001.parquet``, or
``data/<split>-*.parquet`` without configs, or ``<split>.jsonl``/``.json``/``.csv``/``.parquet``
directly in the directory), so a snapshot of the
hub repository works unchanged. Anything that cannot be loaded raises ``SourceError`` with a message
saying how to pass a local path.
"""
import hashlib
import importlib
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


class SourceError(RuntimeError):
    pass


def _split_files(root: Path, split: str) -> List[Path]:
    """Files of ``split`` in ``root``: ``split.ext`` or ``split-00000-of-00002.ext`` (hub shards)."""
    found = [p for p in sorted(root.iterdir()) if p.suffix in FORMATS
             and (p.stem == split or p.stem.startswith(split + "-"))]
    if len({p.suffix for p in found}) > 1:
        raise SourceError(f"{root}: split '{split}' has files of several formats: {[p.name for p in found]}")
    return found


def local_splits(directory: Path, config: Optional[str], splits: Sequence[str], cache_dir=None) -> Dict[str, "object"]:
    """{split: datasets.Dataset} from ``directory/<config>/`` (hub layout) or ``directory/`` itself."""
    import datasets

    roots = [directory / config, directory] if config else [directory / "data", directory]
    for root in roots:
        if not root.is_dir():
            continue
        files = {split: _split_files(root, split) for split in splits}
        if all(files.values()):
            out = {}
            for split, paths in files.items():
                builder = FORMATS[paths[0].suffix]
                out[split] = datasets.load_dataset(builder, data_files={split: [str(p) for p in paths]},
                                                   split=split, cache_dir=cache_dir)
            return out
    wanted = ", ".join(f"{s}.parquet (or {s}-00000-of-0000N.parquet, .jsonl, .csv)" for s in splits)
    raise SourceError(f"{directory}: no files for splits {list(splits)} in "
                      f"{' or '.join(str(r) for r in roots)}; expected {wanted}")


def hub_splits(name: str, config: Optional[str], splits: Sequence[str], cache_dir=None) -> Dict[str, "object"]:
    """{split: datasets.Dataset} from the HuggingFace hub (``datasets.load_dataset(name, config)``)."""
    import datasets

    try:
        return {split: datasets.load_dataset(name, config, split=split, cache_dir=cache_dir) for split in splits}
    except Exception as err:  # offline, unknown name, refused loading script: all end the same way
        raise SourceError(
            f"could not load '{name}'{f' (config {config})' if config else ''} from the HuggingFace hub: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
            f"Without network access, download the dataset elsewhere (e.g. `huggingface-cli download {name} "
            f"--repo-type dataset --local-dir DIR`) and pass the local directory: --source DIR") from err


def load_splits(source: str, config: Optional[str], splits: Sequence[str], cache_dir=None) -> Dict[str, "object"]:
    """A local directory if ``source`` is one, else a hub dataset name."""
    path = Path(source).expanduser()
    if path.is_dir():
        return local_splits(path, config, splits, cache_dir)
    if path.exists() or source.startswith((".", "/", "~")):
        raise SourceError(f"--source {source}: not a directory (pass a hub dataset name or a local directory)")
    return hub_splits(source, config, splits, cache_dir)


def fingerprint(source: str) -> str:
    """A hub name as it is; a local directory as a hash of its files' paths, sizes and times (for markers)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return source
    digest = hashlib.sha1()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = f.stat()
        digest.update(f"{f.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return f"{path.resolve()}@{digest.hexdigest()}"


PREPARE_NEEDS = ("datasets", "sentencepiece")  # every prepare command reads through the one and encodes with the other


def require(*modules: str) -> None:
    """SourceError in one line naming the first of ``modules`` that does not import, and how to install it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise SourceError(f"this command needs the Python package '{name}' ({err}): pip install {name}, "
                              f"or bash scripts/setup_env.sh") from None


def run_cli(main, argv=None) -> None:
    """Run a prepare command once its packages import; a SourceError ends it with its message and exit status 2."""
    try:
        require(*PREPARE_NEEDS)
        main(argv)
    except SourceError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
