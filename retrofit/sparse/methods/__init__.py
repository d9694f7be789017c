"""The built-in sparse methods; importing this package registers them in ``retrofit.sparse.METHODS``."""
from retrofit.sparse.methods import clusterkv, quest, retrieval, seer, streaming  # noqa: F401
