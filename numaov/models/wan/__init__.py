"""Wan 2.1 / 2.2 in the diffusers layout: the transformer (``transformer``) and the text
encoder and VAE graphs the exporter writes (``components``)."""
