"""The engine's fused decode layers (retrofit.generation.fused_layers): installed by default (not with
``fuse_layers=False``), only on the Triton backend and only while the engine runs; a decode step through them gives
the tokens and the cache of the model's own layers, for a dense model and inside a sparse session (rotation and cache
write fused; the session's method selects), with StreamingLLM and in a converted hybrid (their attention runs as
before; norms and MLP fused); q, k and v move once
into one buffer without changing the model's values or bytes; and the fused step stays capturable (the same
operations every step, nothing new allocated in the decode state).

CPU, Triton interpreter, float32, on a tiny random Llama with awkward shapes (hidden 72, 9 query / 3 kv heads of 16
dims, MLP 100, two layers), a ragged batch of two. "Unfused" is the same engine on the same backend with no layer
fused (``fuse_layers=False``): both run the same Triton attention, so they differ only by the fused kernels' float32
rounding (a different summation order in the norms, the down projection's GEMM adding the residual before
rounding): ~1e-7 relative per operation. CACHE_TOL = 1e-5 relative RMS on the caches after the decode bounds that over two layers and a few steps;
a wrong position, head or rotation is of order 1. Greedy tokens are compared exactly (logit gaps are far larger).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from _testing import rel_rms

import retrofit
from retrofit.bench.memory import reachable_tensors
from retrofit.bench.overhead import DispatchCount, triton_launches
from retrofit.generation import StaticGeneration, fused_layers
from retrofit.generation.inputs import SamplingOptions
from retrofit.generation.sampling import TokenChooser
from retrofit.kernels import use_backend
from retrofit.sparse import cache as sparse_cache
from retrofit.sparse import sparse_decoding

CACHE_TOL = 1e-5  # see module docstring
NEW_TOKENS = 5
PROMPT_LENGTH = 20


SHAPE = dict(hidden_size=72, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
             intermediate_size=100, vocab_size=128, max_position_embeddings=512)


def _tiny(architecture: str):
    """A tiny random model of the architecture: Llama, Mistral (no sliding window) or Qwen2 (biases on q, k, v)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config = {"llama": lambda: LlamaConfig(**SHAPE), "mistral": lambda: MistralConfig(sliding_window=None, **SHAPE),
              "qwen2": lambda: Qwen2Config(use_sliding_window=False, **SHAPE)}[architecture]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tiny(one_cpu_thread):
    return _tiny("llama")


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # ragged: row 0 left-padded by 5
    return ids, mask


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused kernels the decode layers call: {"rotary": ..., "add_rms_norm": ...}."""
    counted = {"rotary": 0, "add_rms_norm": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            counted[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fused_layers, "rotary_qk_into_cache", counting("rotary", fused_layers.rotary_qk_into_cache))
    monkeypatch.setattr(sparse_cache, "rotary_qk_into_cache", counting("rotary", sparse_cache.rotary_qk_into_cache))
    monkeypatch.setattr(fused_layers, "add_rms_norm", counting("add_rms_norm", fused_layers.add_rms_norm))
    return counted


@contextlib.contextmanager
def _decoding(model, fuse_layers: bool = True, steps: int = NEW_TOKENS - 1, new_tokens: int | None = None):
    """Inside the block: the engine on the Triton backend, installed, after the prefill and ``steps`` decode steps
    through the fused layers or the model's own; its cache holds ``new_tokens`` (default ``steps + 1``)."""
    ids, mask = _prompt()
    with torch.no_grad(), use_backend("triton"):
        generation = StaticGeneration(model, ids, mask, new_tokens or steps + 1,
                                      TokenChooser(SamplingOptions(), ids.device), [], 0, fuse_layers=fuse_layers)
        with generation.installed():
            generation.prefill()
            for _ in range(steps):
                generation.step()
                generation.after_step()
            yield generation


def _decode(model, fuse_layers: bool = True, steps: int = NEW_TOKENS - 1) -> StaticGeneration:
    """Prefill and ``steps`` decode steps (see :func:`_decoding`); the generation with its cache."""
    with _decoding(model, fuse_layers, steps) as generation:
        return generation


def _static_layers(generation: StaticGeneration) -> list:
    from transformers.cache_utils import StaticLayer

    return [layer for layer in generation.cache.layers if type(layer) is StaticLayer]


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_dense_fused_steps_give_the_unfused_tokens_and_cache(architecture, tiny, calls):
    model = tiny if architecture == "llama" else _tiny(architecture)
    fused = _decode(model)
    assert calls["rotary"] == 2 * (NEW_TOKENS - 1)  # both layers, every decode step, rotated and wrote the cache
    unfused = _decode(model, fuse_layers=False)
    assert torch.equal(fused.out[:, :NEW_TOKENS], unfused.out[:, :NEW_TOKENS])
    for mine, theirs in zip(_static_layers(fused), _static_layers(unfused), strict=True):
        # the layer's bookkeeping is what StaticLayer.update leaves: the same counter, the same buffers
        assert int(mine.cumulative_length) == int(theirs.cumulative_length) == PROMPT_LENGTH + NEW_TOKENS - 1
        assert rel_rms(mine.keys, theirs.keys) < CACHE_TOL and rel_rms(mine.values, theirs.values) < CACHE_TOL


def test_generate_with_fused_layers_equals_the_pytorch_path(tiny):
    """End to end through ``retrofit.generate``: Triton (fused layers) and the CPU's PyTorch path (the model's
    layers, SDPA) choose the same greedy tokens."""
    ids, mask = _prompt()
    tokens = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            tokens[backend] = retrofit.generate(tiny, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                pad_token_id=0, keep_state=False, fuse_layers=True)
    assert torch.equal(tokens["triton"], tokens["torch"])


def test_fusion_is_installed_only_on_triton_and_undone_on_exit(tiny):
    ids, mask = _prompt()
    layers = tiny.model.layers
    for backend, expected in (("torch", None), ("triton", [0, 1])):
        with torch.no_grad(), use_backend(backend):
            generation = StaticGeneration(tiny, ids, mask, 2, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                      fuse_layers=True)
            with generation.installed():
                fusion = generation.fusion
                assert (fusion.fused_layer_indices() if fusion else None) == expected
                assert all(("forward" in layer.__dict__) == (expected is not None) for layer in layers)
        assert generation.fusion is None
        assert not any("forward" in module.__dict__ for module in tiny.modules())  # the classes' forwards again


def test_no_earlier_cache_is_alive_when_a_call_allocates_its_own(tiny, monkeypatch):
    """A call's static cache (and a sparse session's) is freed as soon as the engine drops it, so none is alive when
    the next call allocates its own. Two holders kept them: the fused forwards and their fusion point at each other
    (a cycle, freed only when Python's cycle collector next ran: in a long evaluation on a GPU one cache per call
    piled up), and a sparse session kept its last cache while the next one was allocated."""
    import gc
    import weakref

    caches, alive_at_allocation = [], []
    new_cache = StaticGeneration._new_cache

    def recorded(self):
        cache = new_cache(self)  # its buffers are allocated at the first prefill chunk, after this
        alive_at_allocation.append([ref() is not None for ref in caches])
        caches.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(StaticGeneration, "_new_cache", recorded)
    ids, mask = _prompt()
    options = dict(max_new_tokens=2, eos_token_id=[], pad_token_id=0)
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad(), use_backend("triton"):
            retrofit.generate(tiny, ids, mask, keep_state=False, **options)
            assert caches[0]() is None  # freed on return
            with sparse_decoding(tiny, method="quest", budget=16, page_size=4, dense_layers=()) as session:
                for _ in range(2):
                    retrofit.generate(tiny, ids, mask, **options)
                assert caches[2]() is session.cache is not None  # the session shows the bytes of its last cache
            assert caches[2]() is None
    finally:
        gc.enable()
    assert alive_at_allocation == [[], [False], [False, False]]


def test_the_engine_fuses_by_default_and_not_when_told(tiny):
    """On the Triton backend the engine fuses unless ``fuse_layers=False`` (the model's own layers: the baseline of
    `retrofit bench --engine retrofit-unfused`)."""
    ids, mask = _prompt()
    with torch.no_grad(), use_backend("triton"):
        for options, expected in (({}, [0, 1]), ({"fuse_layers": False}, None)):
            generation = StaticGeneration(tiny, ids, mask, 2, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                          **options)
            with generation.installed():
                fusion = generation.fusion
                assert (fusion.fused_layer_indices() if fusion else None) == expected
                assert any("forward" in module.__dict__ for module in tiny.modules()) == (expected is not None)


def _ops_in_a_decode_step(model, fuse_layers: bool, names: tuple[str, ...] = ("mm", "addmm", "addmm_")) -> int:
    """The aten ops of ``names`` (default: the GEMMs) in the second decode step after the prompt."""
    with _decoding(model, fuse_layers, steps=1, new_tokens=4) as generation, DispatchCount(record=True) as count:
        generation.step()
    return sum(name.split(".")[1] in names for name, _, _ in count.trace)


SESSIONS = {"quest": {"page_size": 4, "dense_layers": ()},
            "clusterkv": {"n_clusters": 4, "iterations": 3, "recluster_every": 2, "new_clusters": 1, "n_sink": 2}}


@pytest.mark.parametrize("budget", [64, 12], ids=["budget-covers-context", "budget-12"])
@pytest.mark.parametrize("method", list(SESSIONS))
def test_a_sparse_sessions_layers_rotate_and_write_fused_and_attend_through_the_session(tiny, calls, method, budget):
    """Quest (page 4) and ClusterKV (re-clustering every 2 tokens), at a budget covering the context and at 12 of its
    24 positions: each layer's decode token is rotated and written by the fused kernel into the session's
    SparseLayer, which then attends through the method's selection; norms and MLP run fused; the tokens, the caches
    and the methods' float metadata (within CACHE_TOL), their integer metadata and the layers' counters are those of
    the unfused engine (the model's own attention module and the cache's update)."""
    with sparse_decoding(tiny, method=method, budget=budget, **SESSIONS[method]):
        fused = _decode(tiny)
        assert calls["rotary"] == 2 * (NEW_TOKENS - 1) and calls["add_rms_norm"] == 2 * (NEW_TOKENS - 1)
        unfused = _decode(tiny, fuse_layers=False)
        gemms = {fuse: _ops_in_a_decode_step(tiny, fuse) for fuse in (True, False)}
    assert torch.equal(fused.out[:, :NEW_TOKENS], unfused.out[:, :NEW_TOKENS])
    for mine, theirs in zip(fused.cache.layers, unfused.cache.layers, strict=True):
        assert (mine.length, mine.seen, mine.new_start) == (theirs.length, theirs.seen, theirs.new_start)
        assert int(mine.write_pos) == int(theirs.write_pos) == PROMPT_LENGTH + NEW_TOKENS - 1
        assert torch.equal(mine.kv_end, theirs.kv_end) and torch.equal(mine.kv_start, theirs.kv_start)
        assert mine.sparse_steps == theirs.sparse_steps == NEW_TOKENS - 1  # every step selected
        assert rel_rms(mine.keys, theirs.keys) < CACHE_TOL and rel_rms(mine.values, theirs.values) < CACHE_TOL
        assert sorted(mine.meta) == sorted(theirs.meta)
        for name, value in mine.meta.items():
            if name.startswith("_"):  # constants built from the layer's shape (common._constant), not state
                continue
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert rel_rms(value, theirs.meta[name]) < CACHE_TOL, name
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs.meta[name]), name
            else:
                assert value == theirs.meta[name], name
    # per layer: q, k, v, o, gate, up, down (7) unfused; q/k/v as one, o, gate, up, down (5) fused; + the LM head
    assert (gemms[False], gemms[True]) == (2 * 7 + 1, 2 * 5 + 1)


def test_streaming_layers_keep_their_attention_and_get_the_fused_norms(tiny, calls):
    """StreamingLLM writes its ring itself (its method's append), so its layers' own attention modules run (q, k and v
    served from one GEMM) while norms and MLP run fused; the tokens are those of the unfused engine."""
    with sparse_decoding(tiny, method="streaming", budget=12, n_sink=2):
        fused = _decode(tiny)
        assert calls["rotary"] == 0 and calls["add_rms_norm"] == 2 * (NEW_TOKENS - 1)
        unfused = _decode(tiny, fuse_layers=False)
    assert torch.equal(fused.out[:, :NEW_TOKENS], unfused.out[:, :NEW_TOKENS])


def test_a_converted_hybrid_fuses_its_softmax_layers_only(tiny, calls, kind="gdn"):
    """Layer 1 converted to Gated DeltaNet: its recurrent layer runs inside the fused layer (norms and MLP fused) with
    the projections of its input (q, k, v, b, a, g) as one GEMM over one buffer that now holds their weights and
    biases (zeros where a module has no bias), layer 0 keeps the fused rotation and cache write; the tokens are those
    of the unfused engine. (KDA's merge: the next test; its prefill under the interpreter takes minutes.)"""
    from retrofit.convert.build import to_hybrid
    from retrofit.hybrid import HybridSection

    hybrid = to_hybrid(tiny, HybridSection(layers=[1], layer_type=kind, base_model_type="llama"))
    converted = hybrid.model.layers[1].self_attn
    before = {name: parameter.detach().clone() for name, parameter in converted.named_parameters()}
    fused = _decode(hybrid)
    assert calls["rotary"] == NEW_TOKENS - 1 and calls["add_rms_norm"] == 2 * (NEW_TOKENS - 1)
    unfused = _decode(hybrid, fuse_layers=False)
    assert torch.equal(fused.out[:, :NEW_TOKENS], unfused.out[:, :NEW_TOKENS])
    inputs = converted.input_projections()
    storages = {module.weight.untyped_storage().data_ptr() for module in inputs}
    assert len(storages) == 1  # the weights moved into one buffer, as row blocks
    assert all(torch.equal(parameter, before[name]) for name, parameter in converted.named_parameters())
    gemms = {fuse: _ops_in_a_decode_step(hybrid, fuse) for fuse in (True, False)}
    # unfused: layer 0's 7; layer 1's projections of its input (GDN: q, k, v, b, a, g; KDA: q, k, v, b, f_a, g_a),
    # KDA's two low-rank up-projections, o, and the MLP's 3; the LM head. Fused: layer 0's 5; layer 1's inputs as 1
    low_rank = 2 if kind == "kda" else 0
    assert gemms == {False: 7 + (6 + low_rank + 1 + 3) + 1, True: 5 + (1 + low_rank + 1 + 3) + 1}
    if kind == "gdn":
        # fused, the GDN layer reads q, k and v (into its conv) and the output gate's logits (into its norm) in place
        # in the merged product: no concatenation and no contiguous copy (before: a cat and a clone). Left in both:
        # the rotary embedding's cat of its frequencies; unfused also layer 0's two rotate_half cats and the GDN
        # layer's cat of its three projections
        copies = {fuse: _ops_in_a_decode_step(hybrid, fuse, ("cat", "clone")) for fuse in (True, False)}
        assert copies == {True: 1, False: 4}


def test_a_hybrids_second_call_reuses_the_kept_generation_after_its_weights_moved(tiny):
    """The first call's fused install moves the converted layer's input projections into one buffer; the state it
    keeps is keyed by the weights where they now are, so the next call of the same bucket reuses it (on CUDA: replays
    its graph) instead of allocating a new cache, and gives a fresh generation's tokens."""
    from retrofit.convert.build import to_hybrid
    from retrofit.generation import kept_generation, release
    from retrofit.hybrid import HybridSection

    hybrid = to_hybrid(tiny, HybridSection(layers=[1], layer_type="gdn", base_model_type="llama"))
    ids, mask = _prompt()
    options = dict(eos_token_id=[], pad_token_id=0)
    with use_backend("triton"):
        release(hybrid)
        storages_before = {module.weight.untyped_storage().data_ptr()
                           for module in hybrid.model.layers[1].self_attn.input_projections()}
        retrofit.generate(hybrid, ids, mask, max_new_tokens=3, **options)
        first = kept_generation(hybrid)
        storages_after = {module.weight.untyped_storage().data_ptr()
                          for module in hybrid.model.layers[1].self_attn.input_projections()}
        assert len(storages_before) > 1 and len(storages_after) == 1  # moved during the first call
        reused = retrofit.generate(hybrid, ids[:, 2:], mask[:, 2:], max_new_tokens=3, **options)
        assert kept_generation(hybrid).generation is first.generation
        fresh = retrofit.generate(hybrid, ids[:, 2:], mask[:, 2:], max_new_tokens=3, keep_state=False, **options)
        release(hybrid)
    assert torch.equal(reused, fresh), (reused != fresh).sum()


def test_a_kda_layers_input_projections_run_as_one_gemm_with_its_own_output():
    """KDA's q, k, v, b, f_a and g_a (only b has a bias) as one merged projection: served to the layer, its output is
    the layer's own within fp32 summation order (1e-5 of its scale: the merged GEMM sums the same products), the
    weights and biases now live in one buffer each, their values unchanged."""
    from retrofit.generation.fused_layers import MergedProjection
    from retrofit.layers import AttentionShape, KimiDeltaAttention

    torch.manual_seed(0)
    shape = AttentionShape(hidden_size=72, num_heads=9, num_kv_heads=3, head_dim=16)
    layer = KimiDeltaAttention(shape, layer_idx=0).eval()
    with torch.no_grad():
        for module in (layer.f_b_proj, layer.g_b_proj, layer.b_proj):  # spread in the gates (they start constant)
            module.weight.normal_(0, 0.1)
    x = torch.randn(2, 1, 72)
    with torch.no_grad():
        own = layer(x)[0]
        merged = MergedProjection.of(layer.input_projections())
        assert merged is not None and merged.sizes == (144, 48, 48, 3, 16, 16)
        with merged.served(layer.input_projections(), x):
            served = layer(x)[0]
    assert rel_rms(served, own) < 1e-5
    modules = layer.input_projections()
    assert len({module.weight.untyped_storage().data_ptr() for module in modules}) == 1
    assert torch.equal(merged.bias[144 + 48 + 48: 144 + 48 + 48 + 3], layer.b_proj.bias)
    assert layer.b_proj.bias.untyped_storage().data_ptr() == merged.bias.untyped_storage().data_ptr()
    assert not merged.bias[:240].any() and not merged.bias[243:].any()  # zeros for the modules without a bias
    # merged again (the engine installs its fused layers on every call): the same buffers, nothing moved, so a decode
    # graph kept from the last call still reads the parameters where they are
    again = MergedProjection.of(modules)
    assert again.bias.data_ptr() == merged.bias.data_ptr() and again.weight_t.data_ptr() == merged.weight_t.data_ptr()


def _storage_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    storages = {parameter.untyped_storage().data_ptr(): parameter.untyped_storage().nbytes()
                for parameter in model.parameters()}
    return sum(storages.values())


def test_q_k_v_move_into_one_buffer_once_keeping_their_parameters_values_and_memory():
    """Qwen2 (biases on q, k, v): after a fused decode each layer's q, k and v weights (and biases) are consecutive row
    blocks of one storage holding exactly them, the same Parameter objects with the same values; the model holds
    the same bytes as before; a second fused run finds them merged and moves nothing."""
    model = _tiny("qwen2")
    attention = model.model.layers[1].self_attn
    modules = [attention.q_proj, attention.k_proj, attention.v_proj]
    for kind in ("weight", "bias"):
        parameters = [getattr(module, kind) for module in modules]
        assert len({parameter.untyped_storage().data_ptr() for parameter in parameters}) == 3
    values = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    objects = {name: id(parameter) for name, parameter in model.named_parameters()}
    held = _storage_bytes(model)
    _decode(model, steps=1)
    assert {name: id(parameter) for name, parameter in model.named_parameters()} == objects
    assert all(torch.equal(parameter, values[name]) for name, parameter in model.named_parameters())
    assert _storage_bytes(model) == held
    for kind in ("weight", "bias"):
        parameters = [getattr(module, kind) for module in modules]
        storage = parameters[0].untyped_storage()
        assert all(parameter.untyped_storage().data_ptr() == storage.data_ptr() for parameter in parameters)
        assert storage.nbytes() == sum(parameter.numel() * parameter.element_size() for parameter in parameters)
        assert [parameter.storage_offset() for parameter in parameters] == [
            0, parameters[0].numel(), parameters[0].numel() + parameters[1].numel()]
    merged_at = attention.q_proj.weight.untyped_storage().data_ptr()
    _decode(model, steps=1)
    assert attention.q_proj.weight.untyped_storage().data_ptr() == merged_at


def test_a_model_decoded_with_fused_layers_saves_and_loads_its_weights(tmp_path):
    """save_pretrained writes the merged q, k, v views as separate tensors; from_pretrained reads the same values."""
    from transformers import AutoModelForCausalLM

    model = _tiny("llama")
    _decode(model, steps=1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    theirs = loaded.state_dict()
    assert sorted(theirs) == sorted(model.state_dict())
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("session", [None, "quest"])
def test_fused_steps_repeat_the_same_operations_and_allocate_no_state(tiny, session):
    """What a CUDA graph needs of the fused step (as tests/test_decode_step.py checks of the model's own layers):
    the same aten operations on the same shapes every step, and the decode state's tensors kept in place; dense, and
    inside a Quest session (its layers rotated and written by the fused kernel, selected by Quest's kernels)."""
    opened = (sparse_decoding(tiny, method="quest", budget=12, page_size=4, dense_layers=()) if session
              else contextlib.nullcontext())
    with opened, _decoding(tiny, steps=1, new_tokens=8) as generation:
        before = reachable_tensors(generation.cache_state())
        traces, launches = [], []
        for _ in range(3):
            # the interpreter's own work inside a launch is hidden: it emulates the kernel on the CPU
            with triton_launches() as launched, DispatchCount(record=True) as count:
                generation.step()
            generation.after_step()
            traces.append(count.trace)
            launches.append(launched[0])
        after = reachable_tensors(generation.cache_state())
    assert before == after
    assert all(trace == traces[0] for trace in traces)
    # per layer, dense: the input norm, the rotation and write, 2 attention kernels, the residual norm, the SiLU-gate
    # (6); Quest adds its page update, page scores and top-k (9); plus the final norm
    assert launches == [2 * (9 if session else 6) + 1] * 3


def _first_step_logits(model, ids, mask, fused: bool) -> torch.Tensor:
    """The logits of the first decode step after the prompt ([B, V], float32), through the fused layers or not."""
    with torch.no_grad():
        generation = StaticGeneration(model, ids, mask, 4, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                      fuse_layers=fused)
        with generation.installed():
            generation.prefill()
            with generation.fusion.decoding() if generation.fusion is not None else contextlib.nullcontext():
                return generation._forward(generation.tokens[:, None], generation.positions, None).float()


@pytest.mark.gpu
def test_bf16_fused_step_is_as_close_to_float32_as_the_models_own_step():
    """bf16 on CUDA (SmolLM2's shapes, 4 random layers): the fused kernels round where the model rounds (the down
    projection's GEMM once instead of twice), so the fused step's logits are as far from the float32 model's as the
    model's own bf16 step is (1.5x that error plus 1e-3 allows for rounding landing differently, while a wrong
    kernel is off by order 1)."""
    from retrofit.bench.configs import build_random_model

    model32 = build_random_model("smollm2-135m", torch.float32, torch.device("cuda"), layers=4)
    model16 = build_random_model("smollm2-135m", torch.bfloat16, torch.device("cuda"), layers=4)
    model16.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in model32.state_dict().items()})
    ids = torch.randint(0, 49152, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    exact = _first_step_logits(model32, ids, mask, fused=False)
    own, fused = (_first_step_logits(model16, ids, mask, fused=flag) for flag in (False, True))
    own_error, fused_error = rel_rms(own, exact), rel_rms(fused, exact)
    assert fused_error <= 1.5 * own_error + 1e-3, (fused_error, own_error)
