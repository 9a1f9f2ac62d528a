"""What the fake model answers to a chat completion: the request read, its tokens counted, the
reply text and its length.

Replies are derived from the image, so tests can prove which page landed where:
``fake-ocr {kind} {w}x{h} mean={gray} sha={digest}`` (kind = first word of the prompt without
its colon, e.g. ``OCR`` or ``Table``; digest = first 12 hex of the sha256 of the decoded RGB
pixels; gray = mean gray level), then deterministic, non-repeating filler words up to the output
length.

Token model: the base line counts as 16 tokens and each filler word as one (so with a cap
below 16 the base line is still sent whole). Image tokens are ceil(w/28)*ceil(h/28) after
scaling the image down (aspect kept) to ``mm_processor_kwargs.max_pixels`` (default
1003520); the text and chat template add len(prompt)//4 + 20.

Output length (``--output-tokens``): ``fixed:N``, ``uniform:A:B`` or ``lognormal:MEAN:SIGMA``
(MEAN is the distribution's mean), drawn from an RNG seeded with the image digest so the
same image always gets the same length; capped by the request's max tokens
(finish_reason ``length``). ``--looping-answers``: every answer repeats one short phrase up to
the request's max tokens (finish_reason ``length``), like a model caught in a loop, whatever the
request asks. Pages are picked by their image width in pixels (``make_pdf`` page i rendered at
scale 2 is ``2 * page_width(i)`` wide): ``--loop-widths W,...`` loop like that unless the
request carries a loop-breaking sampling parameter (``repetition_penalty`` > 1, or a
``frequency_penalty`` / ``presence_penalty`` > 0), as vLLM's would stop; ``--cut-widths`` get
non-repeating text up to the limit (cut off, not a loop); ``--empty-widths`` get an empty answer.
Blocks of a laid-out page are picked by a mark: with ``--loop-marked`` an image with a red mark
on it (``testkit.documents.RED_MARK``) loops like ``--loop-widths``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import itertools
import math
import random
from typing import Any

from aiohttp import web
from PIL import Image, ImageChops, ImageStat

DEFAULT_MAX_PIXELS = 1003520
PATCH_PIXELS = 28
BASE_LINE_TOKENS = 16
FILLER_VOCAB = (
    "lorem", "ipsum", "dolor", "sit", "amet", "page", "text", "line", "word", "book",
    "scan", "table", "cell", "note", "figure", "chapter", "section", "margin", "ink", "paper",
    "column", "row", "title", "index", "verse", "letter", "number", "mark", "quote", "list",
    "item", "end",
)  # fmt: skip
ENGINE_ERROR = "EngineCore encountered an issue. See stack trace (above) for the root cause."


@dataclasses.dataclass(frozen=True)
class OutputLength:
    """An output-length distribution parsed from ``fixed:N|uniform:A:B|lognormal:MEAN:SIGMA``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> OutputLength:
        """Parse a spec; raise ValueError naming the accepted forms."""
        kind, _, rest = spec.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            nums = []
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if (
            arity is None
            or len(nums) != arity
            or min(nums) < 0
            or (kind == "uniform" and nums[0] > nums[1])
            or (kind == "lognormal" and nums[0] <= 0)
        ):
            raise ValueError(
                f"bad output length {spec!r}: use fixed:N, uniform:A:B or lognormal:MEAN:SIGMA"
            )
        return cls(kind, *nums)

    def draw(self, digest: str) -> int:
        """Draw a length (>= 1 token) deterministically from an image digest."""
        rng = random.Random(digest)
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            # mu chosen so that MEAN is the mean, not the median, of the lognormal.
            value = rng.lognormvariate(math.log(self.a) - self.b**2 / 2, self.b)
        return max(1, round(value))

@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What the fake "model" sees of an image."""

    width: int
    height: int
    mean_gray: int
    digest: str
    marked: bool = False  # a red mark is on it (looked for only when asked)


# How much redder than green and blue a pixel of a red mark is, after JPEG's blurring of
# colour (black ink and grey figures stay below 45).
MARK_REDNESS = 60


def analyse_image(data: bytes, find_mark: bool = False) -> ImageInfo:
    """Decode an image and describe it (size, mean gray, digest of the RGB pixels, and with
    `find_mark` whether a red mark is on it)."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    digest = hashlib.sha256(rgb.tobytes()).hexdigest()[:12]
    mean = round(ImageStat.Stat(rgb.convert("L")).mean[0])
    marked = False
    if find_mark:
        red, green, blue = rgb.split()
        redness = ImageChops.subtract(red, ImageChops.lighter(green, blue))
        marked = redness.point(lambda v: 255 * (v >= MARK_REDNESS)).getbbox() is not None
    return ImageInfo(rgb.width, rgb.height, mean, digest, marked)


def image_tokens(width: int, height: int, max_pixels: int) -> int:
    """Vision tokens for an image scaled down (aspect kept) to fit ``max_pixels``."""
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
    return math.ceil(width / PATCH_PIXELS) * math.ceil(height / PATCH_PIXELS)


LOOP_PHRASE_WORDS = 6


def reply_pieces(kind: str, info: ImageInfo, tokens: int, looping: bool = False) -> list[str]:
    """The reply, one piece of text per token (joined, the whole reply): the base line comes
    with the first token and the next BASE_LINE_TOKENS - 1 add nothing; then a filler word each.

    The filler does not repeat itself (a shorter answer is a prefix of a longer one), unless
    `looping`: then one short phrase is repeated, like a model caught in a loop. Streaming
    sends these pieces as they are decoded.
    """
    if tokens <= 0:
        return []
    base = f"fake-ocr {kind} {info.width}x{info.height} mean={info.mean_gray} sha={info.digest}"
    extra = tokens - BASE_LINE_TOKENS
    pieces = [base] + [""] * (min(tokens, BASE_LINE_TOKENS) - 1)
    if extra > 0:
        words = random.Random(info.digest).choices(
            FILLER_VOCAB, k=LOOP_PHRASE_WORDS if looping else extra)
        pieces += [" " + word for word in itertools.islice(itertools.cycle(words), extra)]
    return pieces


def reply_text(kind: str, info: ImageInfo, tokens: int, looping: bool = False) -> str:
    """The whole reply of `tokens` tokens ("" for none; see `reply_pieces`)."""
    return "".join(reply_pieces(kind, info, tokens, looping))


class RequestError(Exception):
    """A request that gets an OpenAI-style error response."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        """The OpenAI/vLLM error body (also what ends a stream that fails mid-answer)."""
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.status,
        }
        return {"error": error}

    def response(self) -> web.Response:
        """The error response."""
        return web.json_response(self.body(), status=self.status)


def engine_error() -> RequestError:
    """The 500 vLLM answers while its engine is dead or failing."""
    return RequestError(500, ENGINE_ERROR, "InternalServerError")


@dataclasses.dataclass
class ChatRequest:
    """The parts of a chat completion request the fake server looks at."""

    model: str
    prompt: str
    image: bytes | None
    max_tokens: int | None
    max_pixels: int
    breaks_loops: bool = False  # a loop-breaking sampling parameter is set
    stream: bool = False  # answer as server-sent events, token by token
    include_usage: bool = False  # a stream ends with a usage chunk
    continuous_usage: bool = False  # every chunk of a stream carries the usage so far (vLLM's)


def parse_chat(body: Any) -> ChatRequest:
    """Pull model, prompt, image and limits out of a request body (400 when malformed)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise RequestError(
            400, "Request body must be a JSON object with messages", "BadRequestError"
        )
    texts: list[str] = []
    image: bytes | None = None
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        parts: list[Any] = [{"type": "text", "text": content}] if isinstance(content, str) else []
        if isinstance(content, list):
            parts = content
        for part in parts:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                ref = part.get("image_url")
                image = _decode_data_url(str(ref.get("url", "")) if isinstance(ref, dict) else "")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(
            400, "max_tokens must be a positive integer", "BadRequestError", "max_tokens"
        )
    mm_kwargs = body.get("mm_processor_kwargs")
    max_pixels = mm_kwargs.get("max_pixels") if isinstance(mm_kwargs, dict) else None
    if not isinstance(max_pixels, int) or max_pixels <= 0:
        max_pixels = DEFAULT_MAX_PIXELS
    def above(key: str, floor: float) -> bool:
        value = body.get(key)
        return isinstance(value, (int, float)) and value > floor

    breaks = (above("repetition_penalty", 1.0) or above("frequency_penalty", 0.0)
              or above("presence_penalty", 0.0))
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    return ChatRequest(str(body.get("model")), "\n".join(texts), image, max_tokens, max_pixels,
                       breaks, body.get("stream") is True, options.get("include_usage") is True,
                       options.get("continuous_usage_stats") is True)


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise RequestError(400, "The fake server only accepts base64 data URLs", "BadRequestError")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"Invalid base64 image: {exc}", "BadRequestError") from exc


def prompt_kind(prompt: str) -> str:
    """``OCR:`` -> ``OCR``, ``Table Recognition:`` -> ``Table``."""
    words = prompt.strip().rstrip(":").split()
    return words[0].rstrip(":") if words else "none"

