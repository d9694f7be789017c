"""What the parts of a conversion cost: a run paused by its time budget (``--max-minutes``) and resumed is one
conversion in several processes, so the wall seconds and the peak memory of the parts so far are kept beside its
training checkpoint (``<work_dir>/parts.json``, written atomically) and the finished run reports all of its parts:
their seconds added, the largest of their peaks."""
from __future__ import annotations

import dataclasses
import json
import os

from retrofit.atomic import write_json
from retrofit.convert.checkpoint import work_dir_for

PARTS_FILE = "parts.json"


@dataclasses.dataclass(frozen=True)
class PartsSoFar:
    """Wall ``seconds`` of the parts so far, added, and the largest ``peak_memory_bytes`` among them, with what that
    peak counts (``peak_memory_measure``: CUDA's allocated tensors, or the process's maximum resident set)."""

    seconds: float = 0.0
    peak_memory_bytes: int = 0
    peak_memory_measure: str = ""

    def plus(self, seconds: float, peak_memory_bytes: int, peak_memory_measure: str) -> PartsSoFar:
        """These parts and one more."""
        if peak_memory_bytes >= self.peak_memory_bytes:
            return PartsSoFar(self.seconds + seconds, peak_memory_bytes, peak_memory_measure)
        return PartsSoFar(self.seconds + seconds, self.peak_memory_bytes, self.peak_memory_measure)


def parts_so_far(out: str | os.PathLike) -> PartsSoFar:
    """The recorded parts of the conversion writing to ``out`` (none recorded: zero seconds, no peak)."""
    try:
        return PartsSoFar(**json.loads((work_dir_for(out) / PARTS_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return PartsSoFar()


def record_parts(out: str | os.PathLike, parts: PartsSoFar) -> None:
    """Keep ``parts`` beside the training checkpoint of ``out`` (nothing to keep beside when no checkpoint folder
    exists: a run paused before its first checkpoint starts again from nothing)."""
    work_dir = work_dir_for(out)
    if work_dir.is_dir():
        write_json(work_dir / PARTS_FILE, dataclasses.asdict(parts))
