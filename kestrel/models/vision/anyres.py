"""LLaVA-NeXT "anyres" tiling, computed forward from the image's size: the image processor resizes the image to
the best of the grid pinpoints and cuts it into tiles of the tower's input size, plus one base tile of the whole
image. The connector lays the tiles' patch features out as one feature map, crops away the padding the resize
added (unpadding), appends the learned image-newline embedding after every row, and puts the base tile's features
first. Token counts come from the same arithmetic, never from counting placeholders."""
from __future__ import annotations

import torch


def select_best_resolution(image_size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """The pinpoint (height, width) that keeps the most of the image's pixels after an aspect-preserving resize,
    then wastes the least area (as the LLaVA-NeXT image processor picks)."""
    h, w = image_size
    best, best_fit, best_waste = None, -1, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        fit = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - fit
        if fit > best_fit or (fit == best_fit and waste < best_waste):
            best, best_fit, best_waste = (ph, pw), fit, waste
    return best


def grid_shape(image_size: tuple[int, int], pinpoints: list, tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles the image is cut into."""
    ph, pw = select_best_resolution(image_size, pinpoints)
    return ph // tile, pw // tile


def num_tiles(image_size: tuple[int, int], pinpoints: list, tile: int) -> int:
    rows, cols = grid_shape(image_size, pinpoints, tile)
    return rows * cols + 1  # + the base tile


def unpadded_shape(image_size: tuple[int, int], current: tuple[int, int]) -> tuple[int, int]:
    """The feature map's (height, width) after cropping the rows or columns that the resize padded."""
    oh, ow = image_size
    ch, cw = current
    if ow / oh > cw / ch:  # wider than the grid: padding above and below
        new_h = int(round(oh * (cw / ow), 7))
        pad = (ch - new_h) // 2
        return ch - 2 * pad, cw
    new_w = int(round(ow * (ch / oh), 7))
    pad = (cw - new_w) // 2
    return ch, cw - 2 * pad


def num_image_tokens(image_size: tuple[int, int], pinpoints: list, tile: int, patches_per_side: int) -> int:
    """Embeddings one image becomes: the base tile's patches + the unpadded grid with one newline per row."""
    rows, cols = grid_shape(image_size, pinpoints, tile)
    h, w = unpadded_shape(image_size, (rows * patches_per_side, cols * patches_per_side))
    return patches_per_side ** 2 + h * (w + 1)


def pack_image_features(features: torch.Tensor, image_size: tuple[int, int], pinpoints: list, tile: int,
                        newline: torch.Tensor) -> torch.Tensor:
    """features [tiles, p*p, C] (base tile first) -> [num_image_tokens, C]."""
    base, grid = features[0], features[1:]
    p = int(round(base.shape[0] ** 0.5))
    rows, cols = grid_shape(image_size, pinpoints, tile)
    if grid.shape[0] != rows * cols:
        raise ValueError(f"{grid.shape[0]} tiles for an image of size {image_size}; its grid is {rows}x{cols}")
    c = grid.shape[-1]
    fmap = grid.view(rows, cols, p, p, c).permute(4, 0, 2, 1, 3).reshape(c, rows * p, cols * p)
    h, w = unpadded_shape(image_size, (rows * p, cols * p))
    top, left = (rows * p - h) // 2, (cols * p - w) // 2
    fmap = fmap[:, top:top + h, left:left + w]
    fmap = torch.cat([fmap, newline.to(fmap.dtype)[:, None, None].expand(c, h, 1)], dim=2)  # newline after each row
    return torch.cat([base, fmap.flatten(1).transpose(0, 1)], dim=0)
