"""What every ``--plot`` shares: matplotlib's pyplot on the Agg backend (imported only when a picture is asked for)
and a figure written atomically as PNG."""
from __future__ import annotations

from pathlib import Path

from retrofit.atomic import atomic_path
from retrofit.errors import RetrofitError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def pyplot():
    """matplotlib.pyplot on the Agg backend; RetrofitError when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RetrofitError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def save_figure(figure, path: Path, dpi: int = 120, rect: tuple[float, float, float, float] | None = None) -> None:
    """Write ``figure`` as PNG to ``path`` atomically, then close it; ``rect`` (left, bottom, right, top, fractions
    of the figure) is where the panels go, leaving the rest to a legend of the figure."""
    plt = pyplot()
    try:
        figure.tight_layout(rect=rect)
        with atomic_path(path) as temporary:
            figure.savefig(temporary, dpi=dpi, format="png")
    finally:
        plt.close(figure)
