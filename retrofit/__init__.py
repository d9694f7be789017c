"""retrofit: make long context cheap for pretrained dense causal LMs."""
from retrofit.errors import RetrofitError
from retrofit.load import load

__version__ = "0.1.0"
__all__ = ["load", "RetrofitError", "__version__"]
