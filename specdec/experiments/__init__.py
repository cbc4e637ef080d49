"""Hydra apps: the zoo recipe (train_zoo), acceptance, rollback comparison, benchmark."""
