"""Many short clips as one video: a grid of tiles, each clip scaled up by a whole factor.

The demo's ``digits.gif`` is ``tile_clips`` of ten clips; ``split_grid`` takes a decoded grid
back apart (the demo's test reads every tile of the file it wrote).
"""

from __future__ import annotations

import numpy as np

from numaov import NumaovError


def tile_clips(clips: np.ndarray, columns: int, scale: int = 1) -> np.ndarray:
    """``[N, F, H, W, C]`` clips -> ``[F, rows * H * scale, columns * W * scale, C]``, clip i
    at row ``i // columns``, column ``i % columns``; empty tiles are black."""
    if clips.ndim != 5 or columns < 1 or scale < 1:
        raise NumaovError(f"clips of shape {list(clips.shape)}, columns={columns}, "
                          f"scale={scale}; expected [N, F, H, W, C] and positive integers")
    n, f, h, w, c = clips.shape
    rows = -(-n // columns)
    grid = np.zeros((rows * columns, f, h, w, c), dtype=clips.dtype)
    grid[:n] = clips
    grid = grid.repeat(scale, axis=2).repeat(scale, axis=3)
    grid = grid.reshape(rows, columns, f, h * scale, w * scale, c)
    return grid.transpose(2, 0, 3, 1, 4, 5).reshape(f, rows * h * scale, columns * w * scale, c)


def split_grid(video: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """``[F, H, W, C]`` grid -> ``[rows * columns, F, H / rows, W / columns, C]`` tiles."""
    f, h, w, c = video.shape
    if h % rows or w % columns:
        raise NumaovError(f"a {w}x{h} grid does not split into {rows} rows x {columns} "
                          "columns of whole tiles; expected sizes that divide")
    tiles = video.reshape(f, rows, h // rows, columns, w // columns, c)
    return tiles.transpose(1, 3, 0, 2, 4, 5).reshape(rows * columns, f, h // rows, w // columns, c)
