"""Dense -> hybrid conversion: weight init from attention, two-stage distillation, checkpoints, save/load."""
