"""Facts recorded beside every result (the ``config`` of eval, bench and conversion reports)."""
from __future__ import annotations


def library_versions() -> dict[str, str]:
    """Versions of retrofit and of the libraries whose numerics the results depend on."""
    import torch
    import transformers

    import retrofit

    return {"retrofit": retrofit.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
