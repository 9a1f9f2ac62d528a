"""What to do with each page result: one action, decided by a pure function.

A page's answer is one per block (with layout detection; one for the page without): each
block is judged, the page's verdict is its worst block's, and a redo sends again only the
blocks that were cut off or looped, each with the setting its own answer calls for
(`redo.Ledger.decide_blocks`), keeping the others' answers (`redo.RedoRecord.keep`).

`decide(result, document, rules)` reads the result and the document (its page's record, its
redo budget) and returns one action (`actions.Action`): `Checkpoint` an answer, `SendAgain`
(a redo, a counted retry after a wait, a page held for later, or a page the server never
saw), a `Placeholder` for a page given up on, or `FailJob`. It changes nothing: the page's
redo record and the budget that the result moves on come back inside the action, as new
values (`redo.Ledger`), and the converter applies the action (store, log, then
`Document.apply`). So every policy path is a plain function call in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.models import trust_mm_kwargs_fix
from ocrvl_daemon.core.actions import Action, Checkpoint, FailJob, Placeholder, SendAgain
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.messages import BlockAnswer, Failure, PageResult
from ocrvl_daemon.core.page import Held
from ocrvl_daemon.core.quality import (
    KeptBecause,
    PageQuality,
    Redo,
    assess,
    flag_note,
    worst_of,
)
from ocrvl_daemon.core.redo import WHOLE_PAGE, BlockRedos, CutBlock, Later, Ledger
from ocrvl_daemon.errors import (
    InputVanishedError,
    PagesFailedError,
    ServerError,
)
from ocrvl_daemon.files.pdf import retry_command

# A page the server failed (HTTP 5xx) waits before it is sent again, longer after each
# failure: a server failing every request is not hammered, and one that failed a moment has
# time to recover.
SERVER_ERROR_BACKOFF = Backoff(1.0, 30.0)
# A document whose server refused this many of its pages with the same words (HTTP 4xx),
# before answering any, fails with those words instead of becoming placeholders: one
# refused page is the page's; the same refusal of several, with nothing answered, is the
# server's (pages go out in parallel, so the first refusals come back before any answer).
REFUSING_PAGES = 3

# What a redo decision chose for a page: send it (or some of its blocks) again with these
# settings, hold it until its document's other pages are in, or keep its answer.
Choice = Redo | BlockRedos | KeptBecause | Held


@dataclass(frozen=True)
class Rules:
    """The settings the decisions follow."""

    page_retries: int  # failed attempts a page may have before it is given up on
    fail_on_page_error: bool  # a page given up on fails its whole document
    external_server: bool  # ocrvl does not run the server (the advice differs)
    server_url: str  # the endpoint named when a result does not say
    again: str = "ocrvl retry"  # the command that redoes a document (`pdf.retry_command`)
    max_new_tokens: int = 4096  # a page's token limit when it is sent as it was

    @classmethod
    def from_config(cls, config: Config, again: str) -> Rules:
        """The rules of `config`, with `again` as the redo command."""
        return cls(config.pipeline.page_retries, config.pipeline.fail_on_page_error,
                   config.server.mode == "external", config.server.base_url, again,
                   config.model.effective_max_new_tokens)


def is_awaited(result: PageResult, document: Document) -> bool:
    """Whether `result` is the answer awaited for its page: sent, and from the endpoint it
    was sent to (not a late one from an endpoint the page was taken from)."""
    sent = document.sent.get(result.page)
    return sent is not None and (not result.url or not sent.endpoint
                                 or sent.endpoint == result.url)


def decide(result: PageResult, document: Document, rules: Rules) -> Action:
    """The action for `result`, an awaited answer (`is_awaited`) of a page of `document`."""
    page = result.page
    if result.error is None:
        ledger = document.ledger(page).counted(result.generated, max(1, len(result.answers)),
                                               result.tokens - result.generated)
        cut_at = result.truncated_at
        choice: Choice | None = None
        if cut_at is not None:
            choice, ledger = _decide_cut(ledger, result, cut_at, document.others_out)
        quality = _judge_page(result)
        ledger = ledger.with_best(quality, result)
        empties = _empty_answers(result, quality)
        if choice is None and empties:
            # Nothing came back for ink (the page's, or a block the layout model found): a
            # fluke of the server is worth one more try at its limit, within the redo budget
            # (DESIGN, Decisions).
            choice, ledger = ledger.retry_empty(rules.max_new_tokens, empties)
            if isinstance(choice, (Redo, BlockRedos)):
                if isinstance(choice, BlockRedos):
                    ledger = ledger.keeping({a.key: a for a in result.answers
                                             if a.key not in choice.redos}, only=True)
                what = _blocks_named(result, _is_empty) or "the answer"
                return SendAgain(page, why=f"p.{page + 1}: {what} came back empty although "
                                           "there is ink; sending it again once", ledger=ledger)
        return _redo_or_keep(document, page, choice, result.looping, ledger, rules, result)
    error = result.error or "unknown error"
    kept = document.page(page).redo.best
    if kept is not None and result.error_kind in (Failure.PAGE, Failure.REFUSED,
                                                  Failure.DAMAGED):
        # A redo that fails costs the page nothing: its earlier answer stays.
        quality, answer = kept
        note = (f"{_quality_note(document, answer, quality, None, rules)} (sending it again "
                f"failed: {error.rstrip('.')})")
        return Checkpoint(page, answer, quality, note)
    if result.error_kind is Failure.SERVER_DOWN:  # not the page's fault: the endpoints say so
        return _keeping_what_came(SendAgain(page), document, result)
    if result.error_kind is Failure.SERVER_ERROR:
        return _keeping_what_came(_server_failed(
            document, page, result.error, result.url or rules.server_url, rules),
            document, result)
    if result.error_kind is Failure.INPUT:  # the worker's own error, of its own kind
        return FailJob(result.problem.rebuilt() if result.problem is not None
                       else InputVanishedError(result.error or "the file changed"))
    if result.error_kind is Failure.DAMAGED:  # the same every time: no retries
        return _give_up(document, page, result.error or "the page is damaged", None, rules)
    action = page_failed(document, page, error, rules)
    if result.error_kind is Failure.REFUSED and not _came_back_good(result):
        refused = document.refused_pages(error) | {page}
        if len(refused) >= REFUSING_PAGES and not document.answered:
            return FailJob(_refuses_every_page(document, len(refused), error,
                                               result.url or rules.server_url, rules))
        if isinstance(action, SendAgain):
            action = replace(action, refused=error)
    if isinstance(action, Placeholder) and result.failed and result.answers:
        return _without_refused_blocks(document, result, error)
    return _keeping_what_came(action, document, result)


def _refuses_every_page(document: Document, pages: int, error: str, url: str,
                        rules: Rules) -> ServerError:
    """The error of a server that refused `pages` pages of `document` with the same words and
    answered none: it will not take this model's requests at all (a vLLM or model that
    ocrvl's requests do not suit, a wrong model name or API key), and a book of placeholders
    would hide that."""
    generic = ("check that it serves a PaddleOCR-VL model as model.name (its "
               "--served-model-name) and takes server.api_key; its own log says why it refuses"
               if rules.external_server else
               "its log says why it refuses; `ocrvl doctor` says whether the server environment "
               "holds the vLLM release ocrvl pins, which `ocrvl setup-server` installs")
    fix = trust_mm_kwargs_fix(error, rules.external_server) or generic
    return ServerError(
        f"The model server at {url} refuses every page of {document.job.path.name} it was "
        f"sent ({pages} pages, none answered), each with: {error.rstrip('.')}.", fix)


def _without_refused_blocks(document: Document, result: PageResult, error: str) -> SendAgain:
    """The last try of a page some of whose blocks (`result.failed`) the server refused on
    every try: its other answers are kept and those blocks answered empty, so the page is put
    together without them instead of becoming a placeholder; it comes back flagged bad, the
    blocks and the server's words in its note (`redo.Ledger.refuse`)."""
    page = result.page
    empty = {key: BlockAnswer(key, "", "stop", 0) for key in result.failed}
    ledger = document.ledger(page).keeping({**_came_back_good(result), **empty})
    ledger = ledger.refuse(result.failed, error)
    return SendAgain(page, why=f"p.{page + 1}: the server refused {len(result.failed)} of its "
                               f"blocks on every try ({error.rstrip('.')}); keeping the page "
                               "without them, flagged", ledger=ledger)


def _keeping_what_came(action: Action, document: Document, result: PageResult) -> Action:
    """`action` for a failed try of a page; where it sends the page again, the answers that
    came back good on that try are kept, so only the other blocks are asked for again (a page
    of 30 blocks would otherwise need all 30 requests to succeed at once)."""
    good = _came_back_good(result)
    if not isinstance(action, SendAgain) or not good:
        return action
    ledger = (action.ledger or document.ledger(result.page)).keeping(good)
    why = action.why and f"{action.why} (the {len(good)} answers that came back kept)"
    return replace(action, ledger=ledger, why=why)


def _came_back_good(result: PageResult) -> dict[str, BlockAnswer]:
    """The answers of a failed try `result` worth keeping: neither cut off nor empty."""
    return {a.key: a for a in result.answers if not _is_to_blame(a)}


def _decide_cut(ledger: Ledger, result: PageResult, cut_at: int, others_out: bool
                ) -> tuple[Choice, Ledger]:
    """The ledger's choice for `result`, cut off at `cut_at`: a page of one answer is decided
    as a whole, a page of blocks block by block (each cut-off block with the limit that cut
    it off); the answers not sent again are noted to keep. A choice that waits (`Later`)
    holds the page with what it is decided again with."""
    cuts = [CutBlock(a.key, a.limit or cut_at, a.looping) for a in result.answers if a.cut]
    ceiling = result.token_ceiling
    if len(result.answers) < 2 or not cuts:
        choice, ledger = ledger.decide(cut_at, ceiling, result.looping, others_out)
        if isinstance(choice, KeptBecause):
            return choice, ledger
        ledger = ledger.keeping({a.key: a for a in result.answers if not a.cut}, only=True)
        if isinstance(choice, Later):
            return Held((CutBlock(WHOLE_PAGE, cut_at, result.looping),), ceiling), ledger
        return choice, ledger
    blocks, ledger = ledger.decide_blocks(cuts, ceiling, others_out)
    if isinstance(blocks, KeptBecause):
        return blocks, ledger
    # A held page keeps them all until `release_held` says which go again.
    ledger = ledger.keeping({a.key: a for a in result.answers}, only=True).without(blocks)
    if isinstance(blocks, Later):
        return Held(tuple(cuts), ceiling, per_block=True), ledger
    return blocks, ledger


def _judge_page(result: PageResult) -> PageQuality:
    """The quality record of a page's answer: its signals over the whole page, and the
    verdict of its worst block."""
    cut = result.truncated_at is not None
    page = assess(result.markdown, "length" if cut else result.finish_reason, result.tokens,
                  result.looping, result.has_ink, result.repetition)
    if len(result.answers) < 2:
        return page  # the page is its one block
    return worst_of(page, [assess(a.text, "length" if a.cut else a.finish_reason, a.tokens,
                                  a.looping, a.has_ink) for a in result.answers])


def _empty_answers(result: PageResult, quality: PageQuality) -> list[str]:
    """The keys of the answers of `result` that are empty although there is ink: the page's
    (WHOLE_PAGE) for a page of one answer, else each such block's."""
    if len(result.answers) < 2:
        return [WHOLE_PAGE] if quality.empty_with_ink else []
    return [a.key for a in result.answers if _is_empty(a)]


def _is_empty(answer: BlockAnswer) -> bool:
    """Empty although its block has ink (a blank block the layout model cut may answer "")."""
    return answer.has_ink and not answer.text.strip()


def _is_cut(answer: BlockAnswer) -> bool:
    return answer.cut


def _is_to_blame(answer: BlockAnswer) -> bool:
    return answer.cut or _is_empty(answer)


def _blocks_named(answer: PageResult, which: Callable[[BlockAnswer], bool]) -> str:
    """The blocks of a page's `answer` that are `which` (cut off, empty), named for a log
    line or note ("block 7 of 30", "blocks 3, 7 of 30"); "" for a page of one block."""
    numbers = [str(n + 1) for n, a in enumerate(answer.answers) if which(a)]
    if len(answer.answers) < 2 or not numbers:
        return ""
    return f"block{'s' * (len(numbers) > 1)} {', '.join(numbers)} of {len(answer.answers)}"


def release_held(document: Document, rules: Rules) -> list[Action]:
    """The actions for the pages held for a second loop-breaking retry, once every other page
    of `document` is in: each is sent again or keeps its best answer. Each decision counts
    the redos the ones before it start."""
    actions: list[Action] = []
    started = 0  # tokens the redos released so far are expected to generate
    for page in document.held():
        held = document.page(page).phase
        assert isinstance(held, Held)
        ledger = document.ledger(page)
        ledger = replace(ledger, others_expected=ledger.others_expected + started)
        before = ledger.record.expected or 0
        choice, ledger = ledger.release(held.cuts, held.ceiling, held.per_block)
        started += (ledger.record.expected or 0) - before
        actions.append(_redo_or_keep(document, page, choice, True, ledger.without(choice), rules))
    return actions


def page_failed(document: Document, page: int, error: str, rules: Rules) -> Action:
    """A failed attempt at `page` (`error`): send it again, counted, or give up on it."""
    attempts = document.page(page).attempts + 1
    if attempts <= rules.page_retries:
        return SendAgain(page, counted=True, why=f"p.{page + 1} failed (attempt {attempts}): "
                                                 f"{error}")
    note = (f"page {page + 1} could not be recognised after {attempts} attempts: "
            f"{error.rstrip('.')}.")
    return _give_up(document, page, note, retry_command(document.job.path, str(page + 1),
                                                         rules.again), rules)


def _redo_or_keep(document: Document, page: int, choice: Choice | None, looping: bool,
                  ledger: Ledger, rules: Rules, latest: PageResult | None = None) -> Action:
    """The action for the ledger's `choice` for `page` (whose last answer, `latest` if known,
    was cut off and `looping`, if `choice` is set; its answers are in `ledger`): send it again,
    hold it until the document's other pages are in, or keep its best answer."""
    kept = ledger.record.best
    assert kept is not None, "a page's record keeps its best answer until it is answered"
    quality, answer = kept
    if isinstance(choice, (Redo, BlockRedos)):
        last = latest or answer
        how = (_how(choice, looping) if isinstance(choice, Redo)
               else _how_blocks_go(last, choice))
        what = _blocks_named(last, _is_cut) or "answer"
        if ledger.record.keep:
            how += f" (the other {len(ledger.record.keep)} answers kept)"
        return SendAgain(page, why=f"p.{page + 1}: {what} cut off; {how}", ledger=ledger)
    if isinstance(choice, Held):
        return SendAgain(page, held=choice, ledger=ledger)
    return Checkpoint(page, answer, quality,
                      _quality_note(document, answer, quality, choice, rules), ledger)


def _how(redo: Redo, looping: bool) -> str:
    """How an answer goes again with `redo`, for a log line (`looping`: it loops)."""
    if looping:
        return f"it loops; sending it again with repetition_penalty {redo.repetition_penalty}"
    return f"redoing it once with {redo.max_new_tokens}"


def _how_blocks_go(answer: PageResult, choice: BlockRedos) -> str:
    """How the blocks of `answer` that `choice` sends again go, for a log line: each named
    ("block 4: redoing it once with 8192; block 7: it loops; ..."), unless it is the page's
    one block cut off."""
    numbers: dict[str, int] = {}
    for n, a in enumerate(answer.answers):
        numbers.setdefault(a.key, n + 1)
    each = sorted((numbers.get(key, 0), _how(redo, key in choice.looping))
                  for key, redo in choice.redos.items())
    if len(each) == 1 and sum(a.cut for a in answer.answers) < 2:
        return each[0][1]
    return "; ".join(f"block {n}: {how}" if n else how for n, how in each)


def _quality_note(document: Document, answer: PageResult, quality: PageQuality,
                  why: Redo | KeptBecause | None, rules: Rules) -> str | None:
    """The note of a page kept although it is not ok (None when it is ok)."""
    where = _blocks_named(answer, _is_to_blame)
    retry = retry_command(document.job.path, str(answer.page + 1), rules.again)
    refused = document.page(answer.page).redo.refused
    if refused is not None and where and quality.reason == "empty":
        return (f"page {answer.page + 1} is {quality.verdict.value}: the server refused "
                f"{where} on every try ({refused.rstrip('.')}); the page is kept without "
                f"{'them' if ',' in where else 'it'}. Redo it with: {retry}")
    return flag_note(answer.page, quality, why, answer.truncated_at, retry,
                     external_server=rules.external_server, where=where)


def _server_failed(document: Document, page: int, error: str | None, url: str,
                   rules: Rules) -> Action:
    """The server at `url` answered `page` with an error (HTTP 5xx): a counted attempt, sent
    again after a wait, or the document fails with the server's words.

    Not a placeholder: the page is not to blame, and the document is tried again later
    (`retry`) with every page it has.
    """
    attempts = document.page(page).attempts + 1
    if attempts <= rules.page_retries:
        wait = SERVER_ERROR_BACKOFF.delay(attempts)
        return SendAgain(page, wait=wait, counted=True,
                         why=f"p.{page + 1}: the server at {url} failed it (attempt {attempts}): "
                             f"{error}; sending it again in {wait:.0f} s")
    return FailJob(ServerError(
        f"The model server at {url} failed page {page + 1} on all {attempts} attempts: "
        f"{(error or 'no reason given').rstrip('.')}.",
        "the server's own log tells why it fails requests (vLLM prints the cause above the "
        "error)"))


def _give_up(document: Document, page: int, note: str, redo: str | None,
             rules: Rules) -> Action:
    """A placeholder for `page`, unless `Rules.fail_on_page_error` fails the document.
    `redo` is the command that tries the page again, when trying again can help."""
    if rules.fail_on_page_error:
        return FailJob(PagesFailedError(note, f"check the page, then run: {redo}"
                                        if redo else None))
    if redo:
        note = f"{note} Redo it with: {redo}"
    return Placeholder(page, note, retryable=redo is not None)
