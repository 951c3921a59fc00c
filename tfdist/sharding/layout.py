"""Which rank updates which elements of the trainable variables, at ZeRO stage 1, 2 or 3.

Stage 1 deals whole variables out, largest first to the least loaded rank; stages 2
and 3 cut each variable alone into N equal slices, one per rank (the backward pass
reduce-scatters each gradient into those slices, `tfdist.sharding.weights`; at stage 3
they are also how the weights are stored). Each gives each rank its pieces (a
variable's flat element range) and, at stage 1, where each variable's elements sit in
the buffer the ranks gather.

`Slicing` is the one place that says how a variable is cut into N equal slices: the
optimizer's layout, the weights' reduce-scatter and all-gather, and the creation of a
stage-3 weight as its slice all read it.

Example:

    layout = ShardLayout([320, 1024, 16], ranks=2, stage=2)
    layout.pieces(1)          # [Piece(0, 160, 320, False), Piece(1, 512, 1024, False), ...]
    layout.widths             # [160, 512, 8]: each rank's slice of each, padding included
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of trainable variable `variable`, flattened."""

    variable: int
    start: int
    stop: int
    whole: bool


@dataclasses.dataclass(frozen=True)
class Slicing:
    """One variable of `size` elements, flattened and cut into `ranks` slices of `width`
    (stages 2 and 3): rank r holds elements [r * width, (r + 1) * width), the last
    slices padded with zeros past `size` (a rank's slice may be all padding).

    Args:
        size: The variable's number of elements.
        ranks: The number of ranks.

    Example:

        slicing = Slicing(size=10, ranks=3)
        slicing.width             # 4: every rank's slice, padding included
        slicing.bounds(2)         # (8, 10): rank 2 holds 2 elements and 2 of padding
        slicing.padded            # 12: the reduce-scatter's input, the all-gather's output
    """

    size: int
    ranks: int

    @property
    def width(self) -> int:
        """Elements in every rank's slice, padding included (at least 1)."""
        return max(1, math.ceil(self.size / self.ranks))

    @property
    def padded(self) -> int:
        """Elements of the flattened variable padded to `ranks` slices of `width`."""
        return self.width * self.ranks

    def bounds(self, rank: int) -> tuple[int, int]:
        """The elements [start, stop) of the variable in rank `rank`'s slice."""
        start = min(rank * self.width, self.size)
        return start, min(start + self.width, self.size)


class ShardLayout:
    """Which rank updates which elements, and where they sit in the gathered buffer.

    Args:
        sizes: Elements of each trainable variable, in order.
        ranks: The number of ranks.
        stage: 1 (whole variables, balanced by size), 2 or 3 (equal slices of each
            variable; a rank's piece of a variable may be empty).

    Example:

        layout = ShardLayout([6, 2, 4], ranks=2, stage=1)
        layout.pieces(1)      # [Piece(1, 0, 2, True), Piece(2, 0, 4, True)]: 6 elements
    """

    def __init__(self, sizes: Sequence[int], ranks: int, stage: int):
        self.sizes = [int(size) for size in sizes]
        self.ranks = ranks
        self.stage = stage
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        if stage == 1:
            owners = _balanced_owners(self.sizes, ranks)
            self._pieces = [[Piece(index, 0, size, True) for index, size in enumerate(self.sizes)
                             if owners[index] == rank] for rank in range(ranks)]
            self._slices = [sum(piece.stop for piece in pieces) for pieces in self._pieces]
            self.position = [0] * len(self.sizes)
            where = 0
            for pieces in self._pieces:  # The gathered buffer: rank 0's variables, rank 1's...
                for piece in pieces:
                    self.position[piece.variable] = where
                    where += piece.stop
        else:
            # Stages 2 and 3: every variable cut alone into N equal slices (the last ones
            # padded): each rank's gradient of a variable is its slice, reduce-scattered
            # as the backward pass produces it, and a variable is gathered by itself.
            self.slicings = [Slicing(size, ranks) for size in self.sizes]
            self.widths = [slicing.width for slicing in self.slicings]
            self._slices = [sum(self.widths)] * ranks
            self.position = offsets[:-1]
            self._pieces = [[Piece(index, *slicing.bounds(rank), False)
                             for index, slicing in enumerate(self.slicings)]
                            for rank in range(ranks)]

    def pieces(self, rank: int) -> list[Piece]:
        """The elements rank `rank` updates, in the order of its gathered contribution."""
        return self._pieces[rank]

    def slice_size(self, rank: int) -> int:
        """Elements rank `rank` contributes to the gathered buffer (padding included)."""
        return self._slices[rank]

    def slice_start(self, rank: int) -> int:
        """Where rank `rank`'s contribution starts in the gathered buffer."""
        return sum(self._slices[:rank])


def _balanced_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """Each variable's rank: largest first, to the rank holding the fewest elements so far
    (ties to the lower rank). No rank then holds more than the mean plus the largest."""
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(ranks)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners
