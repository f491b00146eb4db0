"""Images in requests: a part's URL → its bytes → a checked RGB image, or a 400 naming the part.

`data:` URLs are always read; `http(s)` URLs only from the hosts the operator allows (a server that
fetches whatever URL it is sent is an SSRF hole), with a size cap, a timeout and no redirect leaving
those hosts; every other scheme is refused. Decoding is Pillow's, limited to PNG, JPEG, WebP and GIF
(their first frame), and stops at the image's header when its pixels pass the limit, before any pixel
is decompressed (a decompression bomb declares its size there).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from app.errors import OpenAIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator lets requests' images be (the --*-media-* and image flags)."""

    max_images: int
    max_pixels: int
    max_bytes: int
    fetch_timeout: float
    # Hosts whose http(s) URLs are fetched, lower case; empty: data: URLs only.
    allowed_domains: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ImagePart:
    """An image a request carries, and the parameter path that names it in errors."""

    url: str
    param: str


def _bad(part: ImagePart, message: str) -> OpenAIError:
    return OpenAIError(400, f"{part.param}: {message}", param=part.param, code="invalid_image")


def data_url_bytes(part: ImagePart, policy: MediaPolicy) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    header, comma, payload = part.url.partition(",")
    if not comma:
        raise _bad(part, "a data URL needs a comma before its data")
    media_type, *options = header.removeprefix("data:").split(";")
    if not media_type.lower().startswith("image/"):
        raise _bad(part, f"the data URL's media type is {media_type or 'missing'!r}, not an image type")
    if "base64" not in (option.lower() for option in options):
        raise _bad(part, "an image data URL must be base64-encoded (data:image/png;base64,...)")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise _bad(part, f"the image is over {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(part, f"invalid base64 data: {exc}") from None


async def fetch_bytes(part: ImagePart, policy: MediaPolicy, client: httpx.AsyncClient) -> bytes:
    """The bytes behind an allowed http(s) URL: redirects followed only to allowed hosts, at most
    `max_bytes` read, the whole fetch within `fetch_timeout`."""
    url = part.url
    try:
        for _ in range(_MAX_REDIRECTS + 1):
            _check_remote(part, url, policy)
            async with client.stream("GET", url, timeout=policy.fetch_timeout) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                if response.status_code != 200:
                    raise _bad(part, f"fetching the image returned HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
                    raise _bad(part, f"the image is over {policy.max_bytes} bytes")
                body = bytearray()
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > policy.max_bytes:
                        raise _bad(part, f"the image is over {policy.max_bytes} bytes")
                return bytes(body)
        raise _bad(part, f"fetching the image took more than {_MAX_REDIRECTS} redirects")
    except httpx.TimeoutException:
        raise _bad(part, f"fetching the image took more than {policy.fetch_timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise _bad(part, f"fetching the image failed: {exc}") from None


def _check_remote(part: ImagePart, url: str, policy: MediaPolicy) -> None:
    split = urlsplit(url)
    if split.scheme not in ("http", "https"):
        raise _bad(part, f"{split.scheme or 'a relative'} URL is not accepted; send a data: URL")
    if not policy.allowed_domains:
        raise _bad(part, "remote image URLs are off on this server (--allowed-media-domains); send a data: URL")
    host = (split.hostname or "").lower()
    if host not in policy.allowed_domains:
        raise _bad(part, f"the host {host!r} is not in --allowed-media-domains")


async def image_bytes(part: ImagePart, policy: MediaPolicy, client: httpx.AsyncClient) -> bytes:
    """A part's image bytes: decoded from its data URL, or fetched where its host is allowed."""
    scheme = urlsplit(part.url).scheme.lower()
    if scheme == "data":
        return data_url_bytes(part, policy)
    if scheme in ("http", "https"):
        return await fetch_bytes(part, policy, client)
    raise _bad(part, f"{scheme or 'this'} URL is not accepted: an image is a data: URL or an allowed http(s) URL")


def decode_image(part: ImagePart, data: bytes, policy: MediaPolicy) -> Image.Image:
    """The image in `data` as RGB (a GIF's or animated WebP's first frame), checked against the policy."""
    if len(data) > policy.max_bytes:
        raise _bad(part, f"the image is over {policy.max_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _bad(part, f"the image is over {policy.max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise _bad(part, _unsupported(data)) from None
    # The header alone has been read: the size is what the image declares, nothing decompressed yet.
    width, height = image.size
    if width * height > policy.max_pixels:
        raise _bad(part, f"the image is {width}x{height}, over {policy.max_pixels} pixels")
    try:
        image.seek(0)
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise _bad(part, f"the {image.format} image is corrupt or truncated: {exc}") from None


def _unsupported(data: bytes) -> str:
    """Why Pillow found no accepted format: another image format, or no image at all (the header read
    only: an unsupported format is never decoded)."""
    try:
        other = Image.open(io.BytesIO(data)).format
    except Image.DecompressionBombError:
        other = "an oversized"
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return "the data is not an image (PNG, JPEG, WebP or GIF)"
    return f"unsupported image format {other}; send PNG, JPEG, WebP or GIF"
