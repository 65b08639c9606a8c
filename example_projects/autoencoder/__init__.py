"""autoencoder: an autoencoder whose decoder upsamples with two stride-2 ``ConvTranspose2d``, on the 28×28 digits —
SGD with momentum, BatchNorm in the decoder, BNP (per-channel or exact per-column statistics of the transposed
convolutions) and Adam, at a small batch; squared reconstruction error.

Run: ``python -m example_projects.autoencoder fit --config example_projects/autoencoder/configs/bnp_b4.yaml``
"""

from example_projects.autoencoder.model import Autoencoder

__all__ = ["Autoencoder"]
