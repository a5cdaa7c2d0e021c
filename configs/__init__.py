"""Hydra configs; installed as the package ``vit_mnist.configs`` (see pyproject.toml)."""
