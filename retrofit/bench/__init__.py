"""Speed and memory: prefill/decode latency, tokens/s, peak memory and cache bytes vs context length.

``retrofit bench`` is :mod:`retrofit.bench.command`; :func:`run_bench` measures a loaded model."""
from retrofit.bench.configs import MODEL_CONFIGS, build_random_model
from retrofit.bench.measure import BenchPoint, measure_point, run_bench

__all__ = ["MODEL_CONFIGS", "BenchPoint", "build_random_model", "measure_point", "run_bench"]
