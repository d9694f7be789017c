"""SeerAttention (Gao et al., 2410.13276; SeerAttention-R 2506.08889) in one folder: the decode method and its
learned block gates (``method.py``), the training of the gates from the frozen model (``training.py``), and the
``retrofit gates`` command (``command.py``)."""
from retrofit.sparse.methods.seer.method import GATE_FORMAT, SeerAttention, SeerGate, SeerGates, pool_blocks

__all__ = ["GATE_FORMAT", "SeerAttention", "SeerGate", "SeerGates", "pool_blocks"]
