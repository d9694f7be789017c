"""The named model configurations of speed and memory runs (``retrofit.model_configs``, where they are defined), and
the check that a configuration's weights fit the device before they are built."""
from __future__ import annotations

import torch

from retrofit.errors import RetrofitError
from retrofit.memory import available_bytes
from retrofit.model_configs import MODEL_CONFIGS, build_random_model  # noqa: F401  (their home for bench)


def check_fits(skeleton, device: torch.device, dtype: torch.dtype) -> None:
    """RetrofitError unless the weights of ``skeleton`` (a model of meta tensors: shapes only) fit in the memory
    ``device`` has free, so that an 8B config on a small machine is refused in one line, not killed by the OS."""
    needed = sum(p.numel() for p in skeleton.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = available_bytes(device)
    if free is not None and needed > free:
        raise RetrofitError(f"the weights need {needed / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}; "
                            f"{device} has {free / 2**30:.1f} GiB free (try --dtype bfloat16, --layers N or another "
                            "--device)")

