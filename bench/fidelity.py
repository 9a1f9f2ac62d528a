"""Fidelity: does the Markdown read back the book's words, in order, whole?

    .venv/bin/python -m bench.fidelity [--pdfs DIR] [--pages N] [--write]

Documents: a generated scanned-like book (`testkit.documents.flow_pages`: chapters whose
paragraphs run across pages mid-sentence, long words hyphenated at a page's end; its text is
the truth) and every PDF in `--pdfs DIR` (born-digital PDFs made by others, e.g.
py-pdf/sample-files: their text layer, read with PDFium, is the truth), first `--pages` pages.

Each goes through `ocrvl convert` (a real subprocess) and through PaddleOCR's own
`PaddleOCRVL.predict` + `restructure_pages(concatenate_pages=True)` on the same page images
(rendered by ocrvl's own `pdf.render_page`), both against one stand-in server that reads every
image with a real OCR model (`testkit.fake_server --read-text`: PP-OCRv6, rapidocr), layout
detection off. Per document and contender:

- similarity: difflib's ratio between the output's words and the truth's (order counts);
- lost / doubled: words the assembly dropped or repeated, against what the model answered for
  the pages (a word re-made whole from `docu-` + `ment` counts as those two);
- splits rejoined: page breaks where the truth's paragraph runs on (no sentence end before it),
  and of those, how many read as one paragraph in the output.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pypdfium2

from ocrvl_daemon.output.book import IGNORED_LABELS, is_page_number
from testkit.documents import flow_pages, make_text_pdf
from testkit.harness import free_port, start_fake_server
from testkit.runner import ocrvl_env, run_ocrvl, write_config

RESULTS = Path(__file__).with_name("FIDELITY.md")
_FINISHED = re.compile(r"[.!?:;]['\")\]]*$")
_MARKUP = re.compile(r"<!--.*?-->|<[^>]+>|^---$|^#+ ", re.MULTILINE)
_WORDS = (
    "the harbour town river market morning evening ferry clerk letter record archive "
    "merchant fisherman lantern weather shoreline northern southern journey document "
    "government parliament neighbourhood remembered afterwards particularly extraordinary "
    "collection photograph memorandum correspondence understanding considerable "
    "settlement boundary warehouse lighthouse carpenter blacksmith schoolmaster "
    "a an and of to in on for with from by over under between across through after before "
    "was were had kept found wrote carried opened closed followed returned remained"
)
VOCABULARY = _WORDS.split()


@dataclass
class Row:
    document: str
    contender: str
    pages: int
    similarity: float
    lost: int
    doubled: int
    splits: int
    rejoined: int


_EDGES = ".,;:!?\"'()[]“”‘’«»„"  # typographic quotes too: a reader makes no difference


def words(text: str) -> list[str]:
    """Words as compared: markup, comments and anchors out, case and edge punctuation off."""
    return [w.strip(_EDGES).lower() for w in _MARKUP.sub(" ", text).split() if w.strip(_EDGES)]


def generated_book(pages: int, seed: int = 7) -> list[str]:
    """Chapters of made-up sentences from real words, about `pages` pages set."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    while len(flow_pages(paragraphs)) < pages:
        if len(paragraphs) % 6 == 0:
            paragraphs.append(f"# Chapter {len(paragraphs) // 6 + 1}")
        sentences = []
        for _ in range(rng.randint(4, 9)):
            sentence = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(8, 16)))
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        paragraphs.append(" ".join(sentences))
    return paragraphs


def born_digital_book(path: Path, paragraphs: list[str]) -> Path:
    """A born-digital PDF of `paragraphs` (fpdf2, Helvetica: a real text layer, the truth),
    set as a word processor sets it: paragraphs run on across pages, a table in between."""
    from fpdf import FPDF

    pdf = FPDF(format="letter")
    pdf.set_auto_page_break(auto=True, margin=25)
    pdf.add_page()
    for i, paragraph in enumerate(paragraphs):
        if paragraph.startswith("# "):
            pdf.set_font("Helvetica", "B", 18)
            pdf.multi_cell(0, 10, paragraph[2:], new_x="LMARGIN", new_y="NEXT")
        else:
            pdf.set_font("Helvetica", size=12)
            pdf.multi_cell(0, 6.5, paragraph, new_x="LMARGIN", new_y="NEXT")
        pdf.ln(4)
        if i == 3:  # a table of a few rows
            pdf.set_font("Helvetica", size=11)
            with pdf.table() as rows:
                for r in range(6):
                    cells = rows.row()
                    for c in range(3):
                        cells.cell(VOCABULARY[(r * 3 + c) * 5 % len(VOCABULARY)])
            pdf.ln(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    pdf.output(str(path))
    return path


def first_pages(pdf: Path, copy: Path, count: int) -> None:
    """The first `count` pages of `pdf` as a new PDF `copy`."""
    source = pypdfium2.PdfDocument(pdf)
    new = pypdfium2.PdfDocument.new()
    new.import_pages(source, list(range(min(count, len(source)))))
    new.save(copy)


def truth_of(pdf: Path, limit: int) -> list[str]:
    """Each page's running text from the PDF's own text layer (PDFium): its printed page
    number, a line of its own, is page furniture, as the layout model labels it."""
    document = pypdfium2.PdfDocument(pdf)
    return [running_text(document[i].get_textpage().get_text_bounded())
            for i in range(min(limit, len(document)))]


def running_text(text: str) -> str:
    """`text` without the lines that are a printed page number alone."""
    return "\n".join(line for line in text.splitlines() if not is_page_number(line))


def splits(pages: list[str]) -> list[tuple[str, str]]:
    """(last words, first words) at each page break inside a paragraph of the truth: the
    page's text does not end a sentence and the next page's starts in lower case."""
    found = []
    for before, after in itertools.pairwise(pages):
        # the page's last line and the next page's first (a paragraph's, in the truth)
        end = before.strip().splitlines()[-1].split() if before.strip() else []
        start = after.strip().splitlines()[0].split() if after.strip() else []
        if end and start and not _FINISHED.search(end[-1]) and start[0][:1].islower():
            found.append((" ".join(end[-3:]), " ".join(start[:3])))
    return found


def rejoined(markdown: str, split: tuple[str, str]) -> bool:
    """Whether a split's two sides read as one paragraph: next to each other, a hyphenated
    word made whole."""
    end, start = split
    whole = end[:-1] + start if end.endswith("-") else f"{end} {start}"
    return any(whole in " ".join(_MARKUP.sub("", p).split()) for p in markdown.split("\n\n"))


def dehyphenate(text: str) -> str:
    """A word cut at a line's or page's end made whole (`docu- ment`: `document`)."""
    return re.sub(r"(?<=[^\W\d_])-\s+(?=[^\W\d_])", "", text)


def score(name: str, contender: str, truth: list[str], answered: list[str], markdown: str,
          page_splits: list[tuple[str, str]], hyphen_joins: int) -> Row:
    """One row: the output against the truth, and against what the model answered."""
    out, expected = words(running_text(markdown)), words(dehyphenate(" ".join(truth)))
    said = Counter(words(running_text("\n".join(answered))))
    got = Counter(out)
    # A word made whole from two pieces: the pieces were answered, the word is written.
    lost = sum((said - got).values()) - 2 * hyphen_joins
    doubled = sum((got - said).values()) - hyphen_joins
    similarity = difflib.SequenceMatcher(None, out, expected, autojunk=False).ratio()
    return Row(name, contender, len(truth), similarity, max(lost, 0), max(doubled, 0),
               len(page_splits), sum(rejoined(markdown, s) for s in page_splits))


def pipeline_settings(layout: bool) -> dict[str, object]:
    """The `pipeline:` section both contenders run with (layout on: the stand-in layout model
    on the CPU, from $PADDLE_PDX_CACHE_HOME)."""
    return {"use_layout_detection": True, "layout_device": "cpu"} if layout else {
        "use_layout_detection": False}


def run_ocrvl_convert(pdf: Path, url: str, layout: bool) -> tuple[str, list[str], int]:
    """ocrvl's Markdown, each page's answered text (its JSON's blocks, those PaddleOCR-VL
    leaves out of the Markdown left out here too) and its hyphen joins."""
    config = write_config(pdf.parent / "config.yaml", output={"formats": ["markdown", "json"]},
                          pipeline=pipeline_settings(layout))
    result = run_ocrvl("convert", "--config", config, "--server-url", url, pdf, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"ocrvl convert failed on {pdf.name}:\n{result.stderr}")
    markdown = pdf.with_suffix(".md").read_text("utf-8").split("\n", 1)[1]
    data = json.loads(pdf.with_suffix(".json").read_text("utf-8"))
    answered = [" ".join(b["text"] for b in page["blocks"] if b["label"] not in IGNORED_LABELS)
                for page in data["pages"]]
    return markdown, answered, sum(j["kind"] == "hyphen" for j in data["joins"])


def run_paddleocr(pdf: Path, url: str, limit: int, layout: bool) -> tuple[str, list[str]]:
    """PaddleOCR's own book: `predict` on ocrvl's page images, then `restructure_pages`."""
    from ocrvl_daemon.config.model import Config
    from ocrvl_daemon.engine.worker_settings import pipeline_kwargs
    from ocrvl_daemon.files.pdf import page_count, render_page
    from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl

    config = Config.model_validate({"pipeline": pipeline_settings(layout)})
    pipeline = import_paddleocr_vl()(**pipeline_kwargs(config, url))
    images = [render_page(pdf, i, config.pipeline.render_scale, config.pipeline.page_pixel_limit)
              for i in range(min(limit, page_count(pdf)))]
    results = [res for image in images for res in pipeline.predict(image)]
    answered = [" ".join(str(b.content) for b in r["parsing_res_list"]
                         if b.label not in IGNORED_LABELS) for r in results]
    (book,) = pipeline.restructure_pages(results, merge_tables=True, relevel_titles=True,
                                         concatenate_pages=True)
    return book.markdown["markdown_texts"], answered


def table(rows: list[Row]) -> str:
    lines = ["| document | contender | pages | word-order similarity | words lost | words "
             "doubled | page-break splits rejoined |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.document} | {r.contender} | {r.pages} | {r.similarity:.4f} | {r.lost} | "
              f"{r.doubled} | {r.rejoined}/{r.splits} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pdfs", type=Path, help="a folder of born-digital PDFs (truth: their "
                        "text layer)")
    parser.add_argument("--pages", type=int, default=8, help="pages of each (default 8)")
    parser.add_argument("--layout", action="store_true", help="layout detection on (the test "
                        "kit's stand-in layout model, on the CPU; page numbers on the generated "
                        "book's pages)")
    parser.add_argument("--write", action="store_true", help=f"write the table to {RESULTS.name} "
                        "(the section of this layout setting)")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ocrvl-fidelity-") as tmp, \
            start_fake_server(free_port(), "--read-text") as server:
        work = Path(tmp)
        if args.layout:  # read by `ocrvl convert` and by PaddleX in this process alike
            os.environ["PADDLE_PDX_CACHE_HOME"] = str(write_layout_model(work / "paddlex"))
        documents: list[tuple[Path, list[str]]] = []
        pages = flow_pages(generated_book(args.pages))[:args.pages]
        book = make_text_pdf(work / "generated-book" / "book.pdf", pages, numbered=args.layout)
        documents.append((book, ["\n".join(p).replace("# ", "") for p in pages]))
        typeset = work / "born-digital-book" / "book.pdf"
        typeset.parent.mkdir()
        first_pages(born_digital_book(work / "typeset.pdf", generated_book(args.pages)),
                    typeset, args.pages)
        documents.append((typeset, truth_of(typeset, args.pages)))
        for pdf in sorted(args.pdfs.glob("*.pdf")) if args.pdfs else []:
            (work / pdf.stem).mkdir()
            copy = work / pdf.stem / pdf.name
            first_pages(pdf, copy, args.pages)
            documents.append((copy, truth_of(copy, args.pages)))
        for pdf, truth in documents:
            name = pdf.parent.name
            page_splits = splits(truth)
            markdown, answered, hyphens = run_ocrvl_convert(pdf, server.api_url, args.layout)
            rows.append(score(name, "ocrvl", truth, answered, markdown, page_splits, hyphens))
            markdown, answered = run_paddleocr(pdf, server.api_url, args.pages, args.layout)
            rows.append(score(name, "PaddleOCR predict + restructure_pages", truth, answered,
                              markdown, page_splits, 0))
            print(table(rows[-2:]).split("\n", 2)[2], file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.write:
        write_section(f"Layout detection {'on' if args.layout else 'off'}", (
            f"`python -m bench.fidelity --pages {args.pages}{' --layout' * args.layout}`, "
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores; the stand-in server "
            f"reads with PP-OCRv6 (rapidocr).\n\n{text}\n"))
    return 0


def write_layout_model(cache: Path) -> Path:
    """The test kit's small stand-in PP-DocLayoutV3 where PaddleX looks for the real one."""
    subprocess.run([sys.executable, "-m", "testkit.layout_model", str(cache), "--small"],
                   env=ocrvl_env(), check=True, capture_output=True, timeout=600)
    return cache


def write_section(title: str, body: str) -> None:
    """Put `## title` with `body` into RESULTS, replacing that section if it is there."""
    text = RESULTS.read_text("utf-8") if RESULTS.exists() else (
        "# Fidelity (`python -m bench.fidelity`; see README.md, Fidelity)\n")
    sections = re.split(r"(?m)^(?=## )", text)
    kept = [s for s in sections[1:] if not s.startswith(f"## {title}\n")]
    RESULTS.write_text("".join([sections[0].rstrip("\n") + "\n\n", *kept,
                                f"## {title}\n\n{body}\n"]).replace("\n\n\n", "\n\n"),
                       "utf-8")


if __name__ == "__main__":
    sys.exit(main())
