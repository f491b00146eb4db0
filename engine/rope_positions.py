"""RopePositions: a prompt's rotary positions where a model rotates each token by three positions (time, row,
column: M-RoPE, Qwen2-VL and Qwen2.5-VL) rather than by its index. A text token's three are equal; an image's
tokens take their place in the image's grid, offset by where the image starts; the text after an image goes on
from its largest row or column, so a token's rotary position falls behind its index by what the images before
it saved (`delta` for every token after the prompt)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class RopePositions:
    """Each prompt token's three rotary positions (`axes[a][p]`), and what every later token adds to its index."""

    axes: tuple[array, array, array]
    delta: int

    @classmethod
    def of(cls, num_tokens: int, grids: list[tuple[int, int, int, int]]) -> RopePositions:
        """The positions of a prompt of `num_tokens` whose images' tokens are at (start, time, rows, columns) each
        (their grid as the decoder sees it, after the tower's merge), in order and apart."""
        axes = (array("q"), array("q"), array("q"))
        index = position = 0
        for start, time, rows, columns in grids:
            position = _text(axes, position, start - index)
            for t in range(time):
                for row in range(rows):
                    axes[0].extend([position + t] * columns)
                    axes[1].extend([position + row] * columns)
                    axes[2].extend(range(position, position + columns))
            position += max(rows, columns)
            index = start + time * rows * columns
        _text(axes, position, num_tokens - index)
        return cls(axes, max(map(max, axes)) + 1 - num_tokens if num_tokens else 0)

    def extend(self, start: int, end: int, out: tuple[array, array, array]) -> None:
        """Append the positions of the request's tokens [start, end) to `out`'s three axes."""
        num_prompt = len(self.axes[0])
        cut = min(end, num_prompt)
        for axis, positions in zip(out, self.axes):
            if start < cut:
                axis.extend(positions[start:cut])
            if end > num_prompt:
                axis.extend(range(max(start, num_prompt) + self.delta, end + self.delta))


def _text(axes: tuple[array, array, array], position: int, count: int) -> int:
    """`count` text tokens from rotary position `position`; returns the position after them."""
    for axis in axes:
        axis.extend(range(position, position + count))
    return position + count
