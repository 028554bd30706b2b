"""The Wan video runtime: the text-to-video pipeline over an exported diffusers-layout
directory, the latent sampler and its denoisers, the VAE frame loops, image conditioning and
video output."""
