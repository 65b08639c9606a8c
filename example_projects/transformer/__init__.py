"""transformer: issue 24's two small Transformers, every projection preconditioned by BNP — a ViT on the 28×28
digits (LayerNorm, or no normalization with BNP) and a causal character-level (byte-level) LM on the installed
torch package's sources (SGD with BNP, or Adam).

Run: ``python -m example_projects.transformer fit --config example_projects/transformer/configs/vit_bnp.yaml``
"""

from example_projects.transformer.model import CharLMModule, CorpusDataModule, ViTClassifier

__all__ = ["CharLMModule", "CorpusDataModule", "ViTClassifier"]
