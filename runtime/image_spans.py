"""Where a prompt's images sit among its tokens, and how the prefix cache keys those positions.

Pure Python (no MLX): the generate stage keys its prefix-cache match with it before the engine sees the prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from protocols.ir import ImageSpan

_KEY_BIT = 0x8000_0000  # key tokens of image positions live above every vocabulary (uint32 keys)


def key_tokens(tokens: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The tokens the prefix cache keys a prompt by: its own, except that each image position carries a value
    derived from its image's digest and its place in the image (above every vocabulary id), so a block under an
    image matches only the same pixels at the same place."""
    keyed = list(tokens)
    for span in spans:
        seed = hashlib.sha256(span.digest + span.offset.to_bytes(4, "little")).digest()
        base = int.from_bytes(seed[:4], "little")
        for i in range(span.start, span.end):
            keyed[i] = _KEY_BIT | ((base + (i - span.start) * 0x9E3779B1) & 0x7FFF_FFFF)
    return keyed


def image_spans(ids: Sequence[int], image_token_id: int, digests: Sequence[bytes],
                tokens_per_image: Sequence[int] | None = None) -> tuple[ImageSpan, ...]:
    """The runs of image tokens in ``ids``, each tagged with the digest of the image it belongs to.

    One run per image is the common case. A processor that tiles an image (SmolVLM/Idefics3) writes several
    runs per image, separated by tile markers: ``tokens_per_image`` then assigns runs to images in order (and cuts a
    run that holds several images side by side, as Llama 3.2 Vision's ``<|image|><|image|>``, at their counts). When
    the runs cannot be matched to the images, every run carries the digest of all images together — never a
    false match, just less reuse."""
    runs: list[tuple[int, int]] = []
    start = -1
    for i, token in enumerate(ids):
        if token == image_token_id and start < 0:
            start = i
        elif token != image_token_id and start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(ids)))
    if not runs:
        return ()
    pieces: list[tuple[int, int, bytes]] | None = None
    if len(runs) == len(digests):
        pieces = [(a, b, d) for (a, b), d in zip(runs, digests)]
    elif tokens_per_image is not None and len(tokens_per_image) == len(digests):
        pieces = []
        counts = list(tokens_per_image)
        image = 0
        for run_start, run_end in runs:
            at = run_start
            while at < run_end:  # a run may hold several whole images (Llama 3.2 Vision's <|image|><|image|>)
                while image < len(counts) and counts[image] <= 0:
                    image += 1
                if image >= len(counts):
                    break
                take = min(counts[image], run_end - at)
                pieces.append((at, at + take, digests[image]))
                counts[image] -= take
                at += take
            if at < run_end:  # more image tokens than the images' counts
                pieces = None
                break
        if pieces is not None and any(counts):
            pieces = None
    if pieces is None:
        combined = hashlib.sha256(b"".join(digests)).digest()
        pieces = [(a, b, combined) for a, b in runs]
    spans: list[ImageSpan] = []
    offsets: dict[bytes, int] = {}
    for run_start, run_end, digest in pieces:
        offset = offsets.get(digest, 0)
        spans.append(ImageSpan(run_start, run_end, digest, offset))
        offsets[digest] = offset + (run_end - run_start)
    return tuple(spans)
