"""How ``data/`` was made: small samples derived from the King James Bible (public domain, 1611).

The text comes from Debian's ``bible-kjv-text`` package (read with the ``bible`` program of
``bible-kjv``). From it this script writes, deterministically (fixed seed):
- ``wikitext_kjv/wiki.{train,valid,test}.raw``: books in WikiText-103's raw format (`` = Book = ``,
  `` = = Chapter 1 = = ``, blank lines of one space, punctuation split off, `` @-@ ``, `` 's``);
- ``pg19_sample/{train,validation,test}/*.txt``: one book per file, as a local PG-19 source;
- ``glue_sample/kjv_testament/{train,validation}.jsonl``: single sentences (SST-2 shaped: sentence,
  label, idx): is the verse from the Old (0) or the New (1) Testament;
- ``glue_sample/kjv_next_verse/{train,validation}.jsonl``: sentence pairs (sentence1, sentence2,
  label, idx): does sentence2 directly follow sentence1 (0 next, 1 not_next).
Classification splits are by chapter, and a verse text found in a training chapter (a few verses
repeat) is kept out of validation, so no validation sentence is seen in training.

    python -m linattn_tools.recipes.make_samples --out data                    # apt-get download
    python -m linattn_tools.recipes.make_samples --out data --bible-text kjv.txt  # `bible -p` output
"""
import argparse
import json
import random
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List

Bible = Dict[str, List[List[str]]]  # book -> chapters -> verses

OLD_TESTAMENT_LAST_BOOK = "Malachi"
WIKITEXT_BOOKS = {"train": ["Genesis", "Proverbs", "Matthew", "Acts", "Romans"],
                  "valid": ["Ruth", "James"], "test": ["Esther", "1 Peter"]}
PG19_BOOKS = {"train": ["Exodus", "Joshua", "Judges", "Mark", "John"],
              "validation": ["Lamentations", "Colossians"], "test": ["Ecclesiastes", "Galatians"]}
OLD_POOL = ["Psalms", "Isaiah"]  # classification sets: books used nowhere else
NEW_POOL = ["Luke", "Revelation", "2 Corinthians", "Ephesians", "Hebrews"]
TESTAMENT_SIZES = {"train": 1000, "validation": 200}  # per class
NEXT_VERSE_SIZES = {"train": 1200, "validation": 300}
MAX_CHARS = 300  # classification sentences; WikiText paragraphs are cut at clauses to about this
SEED = 1611

_VERSE = re.compile(r"^  (\d+) (.*)$")
_HEADER = re.compile(r"^(\S.*) (\d+)$")


def bible_text_from_debian(workdir: Path) -> str:
    """`bible -p` over the whole text of Debian's bible-kjv + bible-kjv-text (apt-get download, dpkg -x)."""
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=workdir, check=True)
    for deb in sorted(workdir.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(workdir / "root")], check=True)
    root = workdir / "root" / "usr"
    out = subprocess.run([str(root / "bin" / "bible"), "-p", str(root / "lib"), "Gen1:1-Rev22:21"],
                         capture_output=True, text=True, check=True)
    return out.stdout


def parse_bible(text: str) -> Bible:
    """`bible -p` output (a 'Book N' line between blank lines, then '  V text' wrapped verses)."""
    bible: Bible = {}
    verses = None
    previous_blank = True
    for line in text.splitlines():
        header = _HEADER.match(line) if previous_blank else None
        verse = _VERSE.match(line)
        if header:
            verses = []
            bible.setdefault(header.group(1), []).append(verses)
        elif verse:
            verses.append(verse.group(2).strip())
        elif line.strip():
            verses[-1] += " " + line.strip()  # a wrapped verse goes on
        previous_blank = not line.strip()
    return bible


def wikitext_tokens(text: str) -> str:
    """WikiText-103's tokenisation: punctuation split off, @-@ / @,@ / @.@ inside words and numbers."""
    text = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", text)
    text = re.sub(r"(?<=\d),(?=\d)", " @,@ ", text)
    text = re.sub(r"(?<=\d)\.(?=\d)", " @.@ ", text)
    text = re.sub(r"(?<=\w)'s\b", " 's", text)
    text = re.sub(r"(?<=s)'(?=\s|$)", " '", text)
    text = re.sub(r"(?<!@)([.,;:!?()\"])(?!@)", r" \1 ", text)
    return " ".join(text.split())


def clauses(verse: str, max_chars: int = MAX_CHARS) -> List[str]:
    """Cut a long verse after ';' or ':' into pieces of at most about ``max_chars``."""
    pieces, current = [], ""
    for part in re.split(r"(?<=[;:]) ", verse):
        if current and len(current) + len(part) + 1 > max_chars:
            pieces.append(current)
            current = part
        else:
            current = f"{current} {part}" if current else part
    return pieces + [current]


def wikitext_article(book: str, chapters: List[List[str]]) -> List[str]:
    """Lines of one WikiText article (each line starts with a space; blank lines are ' ')."""
    lines = [" ", f" = {book} = ", " "]
    for number, verses in enumerate(chapters, 1):
        lines += [f" = = Chapter {number} = = ", " "]
        lines += [f" {wikitext_tokens(piece)} " for verse in verses for piece in clauses(verse)]
        lines.append(" ")
    return lines


def book_text(book: str, chapters: List[List[str]]) -> str:
    """A book as a plain-text file (title, 'Chapter N' headings, 'c:v text' lines), like a PG-19 book."""
    parts = [f"The Book of {book}\n"]
    for c, verses in enumerate(chapters, 1):
        parts.append(f"\nChapter {c}\n\n" + "".join(f"{c}:{v} {text}\n" for v, text in enumerate(verses, 1)))
    return "".join(parts)


def _split_chapters(bible: Bible, books: List[str], rng: random.Random) -> Dict[str, List[List[str]]]:
    """{'train': chapters, 'validation': chapters}: a fifth of each book's chapters for validation."""
    out = {"train": [], "validation": []}
    for book in books:
        chapters = list(bible[book])
        rng.shuffle(chapters)
        cut = max(1, len(chapters) // 5)
        out["validation"] += chapters[:cut]
        out["train"] += chapters[cut:]
    return out


def testament_task(bible: Bible, rng: random.Random) -> Dict[str, List[dict]]:
    """SST-2 shaped rows: sentence, label (0 old, 1 new), idx."""
    pools = [_split_chapters(bible, OLD_POOL, rng), _split_chapters(bible, NEW_POOL, rng)]
    seen = {v for pool in pools for chapter in pool["train"] for v in chapter}  # repeated verses stay in train
    rows = {}
    for split, per_class in TESTAMENT_SIZES.items():
        examples = []
        for label, pool in enumerate(pools):
            verses = [v for chapter in pool[split] for v in chapter
                      if len(v) <= MAX_CHARS and (split == "train" or v not in seen)]
            examples += [(v, label) for v in rng.sample(verses, per_class)]
        rng.shuffle(examples)
        rows[split] = [{"sentence": v, "label": label, "idx": i} for i, (v, label) in enumerate(examples)]
    return rows


def next_verse_task(bible: Bible, rng: random.Random) -> Dict[str, List[dict]]:
    """Pair rows: sentence1, sentence2, label (0 = sentence2 is the next verse, 1 = a verse 3+ away), idx."""
    pool = _split_chapters(bible, OLD_POOL + NEW_POOL, rng)
    seen = {v for chapter in pool["train"] for v in chapter}
    short = MAX_CHARS // 2
    rows = {}
    for split, size in NEXT_VERSE_SIZES.items():
        chapters = [c for c in pool[split] if len(c) >= 6]
        examples = []
        while len(examples) < size:
            chapter = rng.choice(chapters)
            i = rng.randrange(len(chapter) - 1)
            label = len(examples) % 2
            j = i + 1 if label == 0 else rng.choice([k for k in range(len(chapter)) if abs(k - i) >= 3])
            fresh = split == "train" or not {chapter[i], chapter[j]} & seen
            if len(chapter[i]) <= short and len(chapter[j]) <= short and fresh:
                examples.append((chapter[i], chapter[j], label))
        rng.shuffle(examples)
        rows[split] = [{"sentence1": a, "sentence2": b, "label": label, "idx": n}
                       for n, (a, b, label) in enumerate(examples)]
    return rows


def _slug(book: str) -> str:
    return book.lower().replace(" ", "_")


def write_samples(bible: Bible, out: Path) -> None:
    rng = random.Random(SEED)
    for split, books in WIKITEXT_BOOKS.items():
        lines = [line for book in books for line in wikitext_article(book, bible[book])]
        (out / "wikitext_kjv").mkdir(parents=True, exist_ok=True)
        (out / "wikitext_kjv" / f"wiki.{split}.raw").write_text("".join(line + "\n" for line in lines))
    for split, books in PG19_BOOKS.items():
        (out / "pg19_sample" / split).mkdir(parents=True, exist_ok=True)
        for n, book in enumerate(books):
            (out / "pg19_sample" / split / f"{n:02d}_{_slug(book)}.txt").write_text(book_text(book, bible[book]))
    for task, rows in (("kjv_testament", testament_task(bible, rng)), ("kjv_next_verse", next_verse_task(bible, rng))):
        (out / "glue_sample" / task).mkdir(parents=True, exist_ok=True)
        for split, split_rows in rows.items():
            with open(out / "glue_sample" / task / f"{split}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in split_rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.make_samples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the data/ directory")
    parser.add_argument("--bible-text", help="output of `bible -p DIR Gen1:1-Rev22:21` (default: fetch the "
                                             "Debian packages with apt-get download)")
    args = parser.parse_args(argv)
    if args.bible_text:
        text = Path(args.bible_text).read_text()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            text = bible_text_from_debian(Path(tmp))
    write_samples(parse_bible(text), Path(args.out))


if __name__ == "__main__":
    main()
