"""Where a prompt's images sit and how the prefix cache keys them (runtime/image_spans.py)."""

from __future__ import annotations

from runtime.image_spans import image_spans, key_tokens

IMG = 9
A, B = b"a" * 32, b"b" * 32


def test_one_run_per_image_takes_the_images_in_order() -> None:
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    spans = image_spans(ids, IMG, [A, B])
    assert [(s.start, s.end, s.digest, s.offset) for s in spans] == [(1, 3, A, 0), (4, 7, B, 0)]


def test_tiled_images_are_assigned_runs_by_their_token_counts() -> None:
    ids = [1, IMG, IMG, 5, IMG, IMG, 6, IMG, IMG, 2]
    spans = image_spans(ids, IMG, [A, B], tokens_per_image=[4, 2])
    assert [(s.digest, s.offset) for s in spans] == [(A, 0), (A, 2), (B, 0)]


def test_a_run_of_several_images_is_cut_at_their_counts() -> None:
    """Llama 3.2 Vision writes one <|image|> token per image: two images side by side are one run of two."""
    ids = [1, IMG, IMG, 2, IMG, 3]
    C = b"c" * 32
    spans = image_spans(ids, IMG, [A, B, C], tokens_per_image=[1, 1, 1])
    assert [(s.start, s.end, s.digest, s.offset) for s in spans] == [(1, 2, A, 0), (2, 3, B, 0), (4, 5, C, 0)]


def test_runs_that_cannot_be_matched_share_the_digest_of_all_images() -> None:
    ids = [1, IMG, IMG, 5, IMG, 6, IMG, 2]
    spans = image_spans(ids, IMG, [A, B], tokens_per_image=[3, 3])  # 4 image tokens, not 6
    assert len({s.digest for s in spans}) == 1 and spans[0].digest not in (A, B)


def test_key_tokens_depend_on_the_pixels_and_the_place_never_on_the_token_id() -> None:
    ids = [1, IMG, IMG, 2, IMG, IMG, 3]
    one = key_tokens(ids, image_spans(ids, IMG, [A, B]))
    swapped = key_tokens(ids, image_spans(ids, IMG, [B, A]))
    again = key_tokens(ids, image_spans(ids, IMG, [A, B]))
    assert one == again and one != swapped
    assert one[0] == 1 and one[3] == 2 and one[6] == 3  # text positions keep their ids
    image_keys = [one[i] for i in (1, 2, 4, 5)]
    assert len(set(image_keys)) == 4 and all(k >= 2**31 for k in image_keys)  # above every vocabulary
    assert swapped[1:3] == one[4:6]  # an image's keys follow it (its place within the image, its pixels)


def test_3d_position_models_are_told_by_their_config() -> None:
    from runtime.vision import declares_mrope

    # 3-D (M-RoPE) positions are served: each row's own, from mlx-vlm's get_rope_index (runtime/passes.py).
    assert declares_mrope({"model_type": "qwen2_5_vl"}) and not declares_mrope({"model_type": "gemma3"})
    assert declares_mrope({"model_type": "custom", "text_config": {
        "rope_scaling": {"type": "default", "mrope_section": [16, 24, 24]}}})
    assert not declares_mrope({"model_type": "mllama"})  # cross-attention (runtime/cross_attention.py): 1-D
