"""bench.fidelity's measures: they see a lost, doubled or misordered word and a split left
apart, so the table of record can show a failure."""

from __future__ import annotations

import pytest

from bench.fidelity import generated_book, score, splits
from testkit.documents import flow_pages

TRUTH = ["The ferry crossed the grey water toward the", "northern pier before the market."]
ANSWERED = TRUTH


@pytest.mark.quick
def test_a_faithful_book_scores_full_marks() -> None:
    row = score("b", "x", TRUTH, ANSWERED, "The ferry crossed the grey water toward the "
                "<!-- page 2 --><a id=\"page-2\"></a>northern pier before the market.",
                splits(TRUTH), 0)
    assert (row.similarity, row.lost, row.doubled, row.splits, row.rejoined) == (1, 0, 0, 1, 1)


@pytest.mark.quick
@pytest.mark.parametrize(("markdown", "lost", "doubled"), [
    ("The ferry crossed the grey water toward the\n\nnorthern pier the market.", 1, 0),
    ("The ferry crossed the grey water toward the\n\nnorthern pier pier before the market.",
     0, 1),
])
def test_a_lost_or_doubled_word_is_counted(markdown: str, lost: int, doubled: int) -> None:
    row = score("b", "x", TRUTH, ANSWERED, markdown, splits(TRUTH), 0)
    assert (row.lost, row.doubled, row.rejoined) == (lost, doubled, 0)
    assert row.similarity < 1


@pytest.mark.quick
def test_misordered_pages_lower_the_similarity() -> None:
    row = score("b", "x", TRUTH, ANSWERED, "\n\n".join(TRUTH[::-1]), splits(TRUTH), 0)
    assert row.similarity < 0.7 and row.lost == row.doubled == 0


@pytest.mark.quick
def test_a_hyphenated_split_counts_only_when_made_whole() -> None:
    truth = ["Nobody had seen such a docu-", "ment before."]
    whole = score("b", "x", truth, truth, "Nobody had seen such a document before.",
                  splits(truth), 1)
    apart = score("b", "x", truth, truth, "Nobody had seen such a docu-\n\nment before.",
                  splits(truth), 0)
    assert (whole.rejoined, whole.lost, whole.doubled, whole.similarity) == (1, 0, 0, 1)
    assert apart.rejoined == 0


@pytest.mark.quick
def test_the_generated_book_runs_paragraphs_and_words_across_pages() -> None:
    pages = flow_pages(generated_book(6))
    assert len(pages) >= 6
    ends = [page[-1] for page in pages[:-1]]
    assert any(end.endswith("-") for end in ends), "no word is hyphenated at a page's end"
    assert sum(not end.endswith(".") for end in ends) >= 2, "no paragraph runs across pages"
