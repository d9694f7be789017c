"""Hybrid checkpoints written by earlier versions of retrofit still load and compute the same function.

The fixtures (tests/fixtures/README.md) were written and scored by the code of 2026-12-01 before its layout changed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("loader", ["retrofit", "transformers"])
def test_checkpoint_written_before_the_relayout_loads(kind, loader):
    import retrofit
    from transformers import AutoModelForCausalLM

    path = FIXTURES / f"hybrid_v1_{kind}"
    expected = load_file(str(path / "expected.safetensors"))
    if loader == "retrofit":
        from retrofit.hybrid import load_hybrid

        model = load_hybrid(path)
    else:
        assert retrofit.__version__  # registering the hybrid classes is what `import retrofit` does
        model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    assert model.config.retrofit["layer_type"] == kind
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], use_cache=False).logits
        prompt = expected["input_ids"][:1, :9]
        generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                   do_sample=False, pad_token_id=0)
    # Same code path and dtype as when the fixture was scored: only float32 summation order may differ.
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(generated, expected["generated"])
