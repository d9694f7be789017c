"""Run by ``torchrun --nproc-per-node 2`` (CPU, gloo) from ``tests/test_convert.py``: two stage-1 and two stage-2
steps of SmolLM2 -> GDN (layer 27) under ``parallel: fsdp``, built as the pipeline builds it (the student holds the
teacher's frozen weights), measuring what each process holds. Writes ``OUT/rank<R>.json``:

- ``whole``: bytes of the dense model's weights, what one process holds frozen (the hybrid holds the same storage);
- ``held``: stage -> bytes of frozen weights this process holds once FSDP has wrapped them (over the dense model,
  the hybrid and the stage's teacher and student);
- ``student_adds``: stage -> bytes the student's frozen weights add to the teacher's (0: one set of shards);
- ``same_gathered``: whether, while the teacher runs layer 27's MLP in stage 2's second step, the student's module
  holds the very (all-gathered, full-shaped) tensor the teacher's does: one all-gather serves both;
- ``dense_unchanged``: whether every weight of the dense model is back, bit for bit, after training;
- ``hybrid_plain``: whether the trained hybrid holds plain tensors only, its layer 0 the dense model's storage again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path, data: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    import retrofit
    from retrofit.convert.build import to_hybrid
    from retrofit.convert.data import token_windows
    from retrofit.convert.distill import Distiller
    from retrofit.convert.plan import DistillConfig
    from retrofit.convert.recipe import load_recipe
    from retrofit.convert.sharding import frozen_bytes_held
    from retrofit.hybrid import HybridSection

    dense, tokenizer = retrofit.load("smollm2-135m", dtype="float32", device="cpu")
    before = {name: p.detach().clone() for name, p in dense.named_parameters()}
    hybrid = to_hybrid(dense, HybridSection(layers=[27], layer_type="gdn", base_model_type="llama"),
                       share_weights=True, layer_dtype=torch.float32)
    recipe = load_recipe("smollm2-135m/cpu-small")
    settings = {k: recipe[k] for k in DistillConfig.field_names() if k in recipe}
    # 2 processes x 1 window x 32 tokens = 64 tokens a step: two steps of each stage
    config = DistillConfig(**{**settings, "tokens": 256, "seq_len": 32, "batch_size": 1, "stage1_fraction": 0.5,
                              "checkpoint_every": 0, "parallel": "fsdp"})
    windows = token_windows(tokenizer, [str(data)], 8, 32, seed=0, show_progress=False)
    dense.requires_grad_(False)
    report: dict = {"whole": frozen_bytes_held(dense), "student_adds": {}, "same_gathered": []}

    def look(stage: int, step: int) -> None:
        """After each step: what the student's frozen weights add; after stage 2's first, a hook for the next
        teacher pass comparing what the teacher's and the student's layer-27 MLP hold while the teacher runs it."""
        running = distiller.running
        report["student_adds"][stage] = (frozen_bytes_held(running.teacher, running.checkpointed)
                                         - frozen_bytes_held(running.teacher))
        if (stage, step) != (2, 0):
            return
        teacher_mlp, student_mlp = running.teacher.model.layers[27].mlp, running.student_root.model.model.layers[27].mlp

        def compare(*_):
            gathered = teacher_mlp.up_proj.weight
            report["same_gathered"].append(student_mlp.up_proj.base_layer.weight is gathered
                                           and gathered.shape == before["model.layers.27.mlp.up_proj.weight"].shape)

        teacher_mlp.register_forward_hook(compare)

    distiller = Distiller(dense, hybrid, [27], config, windows, out / "work", {}, torch.device("cpu"),
                          show_progress=False, on_step=look)
    model = distiller.run()
    report["held"] = distiller.frozen_bytes_held
    report["dense_unchanged"] = all(torch.equal(p, before[name]) for name, p in dense.named_parameters())
    report["hybrid_plain"] = (all(type(p) is torch.nn.Parameter for p in model.parameters())
                              and model.model.layers[0].mlp.up_proj.weight.data_ptr()
                              == dense.model.layers[0].mlp.up_proj.weight.data_ptr())
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
